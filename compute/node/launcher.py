"""Service processes on this machine: `pdserve node` and `pdserve gateway` started, awaited and stopped.

Used by the benchmarks and the end-to-end tests (the local actuator, which also drains and
re-registers nodes, is ``autoscaler.local``). Lifecycle of one process: ``Services.node`` /
``Services.gateway`` picks a free loopback port and spawns the command in its own process group,
tied to this process (``lifeline``: it ends when we do, even on SIGKILL), with its output in
``<log_dir>/<name>-<port>.log`` -> ``wait_ready`` polls ``/ready`` (bounded; a process that exits
early raises with the tail of its log) -> ``stop`` (SIGTERM, then SIGKILL to the group after 10 s)
or ``kill9``; ``Services.stop_all`` ends every one still running.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from compute.node.auth import SignedAuth
from compute.node.lifeline import spawn_kwargs

# PDSERVE_NIXL_TRUSTED_FABRIC: a test's or benchmark's nodes are one another's only NIXL peers (its own loopback or
# test network), so --kv-transport nixl is allowed (compute/node/config.py NIXL_UNBOUNDED)
SERVICE_ENV = {"PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN",
               "TOKENIZERS_PARALLELISM": "false", "PDSERVE_NIXL_TRUSTED_FABRIC": "1"}  # fmt: skip
SAME = "<the Services' model>"  # Services.node/start: the model given to Services
_KEYS = ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY", "PDSERVE_API_KEYS_FILE", "PDSERVE_ADMIN_KEY_FILE")


def service_env(token: str, **extra: str) -> dict:
    """This environment with the internal token, loopback-only UCX, and no API keys unless given."""
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=token, **SERVICE_ENV)
    for k in _KEYS:
        env.pop(k, None)
    env.update(extra)
    return env


class ServiceProc:
    """One started service process."""

    def __init__(self, name: str, cmd: list[str], url: str, log_dir: str, env: dict, auth=None):
        self.name, self.url, self.auth = name, url, auth  # auth: signs requests to its internal API (SignedAuth)
        self.admin_headers: dict[str, str] = {}  # a gateway's: its admin key
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        # the parent-death signal only from the main thread: it follows the forking thread, not the process
        kw = spawn_kwargs(env, pdeathsig=threading.current_thread() is threading.main_thread())
        self.p = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.started = time.monotonic()
        self.ready_s: float | None = None  # seconds from spawn to the first 200 on /ready

    def wait_ready(self, timeout: float = 180.0, path: str = "/ready") -> "ServiceProc":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.p.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + path, auth=self.auth, timeout=2).status_code == 200 and self.p.poll() is None:
                    self.ready_s = time.monotonic() - self.started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()  # a caller that never gets it back cannot stop it: not ready in time is stopped here
        raise TimeoutError(f"{self.name} not ready in {timeout:g} s: {self.log()[-2000:]}")

    def load(self) -> dict:
        """The node's /load (``protocol.LoadReport``) as a dict."""
        from compute.node.client import SyncNodeClient

        with SyncNodeClient(None, auth=self.auth) as client:
            return client.load(self.url).as_dict()

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def kill9(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
        self._log.close()


_GIVEN: dict[int, float] = {}  # port -> when free_port handed it out (its process may not have bound it yet)
_GIVEN_LOCK = threading.Lock()
RESERVE_S = 120.0  # a port handed out is not handed out again for this long


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS picks it; the process started next binds it), and not one this process
    handed out in the last ``RESERVE_S``: until the process started with it binds it, the OS may pick it again,
    and two services given one port left one of them unbound while its URL answered for the other (a gateway
    "ready" because the node on its port was)."""
    with _GIVEN_LOCK:
        now = time.monotonic()
        for port, at in list(_GIVEN.items()):
            if now - at > RESERVE_S:
                del _GIVEN[port]
        for _ in range(64):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _GIVEN:
                _GIVEN[port] = now
                return port
    raise OSError(f"no free port on {host} outside the {len(_GIVEN)} handed out recently")


class Services:
    """Starts nodes and gateways of one model and store; ``stop_all`` ends every one still running."""

    def __init__(self, store: list[str], model: str | None, log_dir: str, token: str | None = None,
                 env: dict | None = None):  # fmt: skip
        self.store, self.model, self.log_dir = store, model, log_dir
        self.token = token or secrets.token_hex(16)
        self.auth = SignedAuth(self.token)  # signs requests to the nodes (and the gateways' /internal)
        self.admin_key = secrets.token_hex(16)  # the gateways' admin key (their admin API is closed without one)
        self.admin_headers = {"Authorization": f"Bearer {self.admin_key}"}
        self.env = service_env(self.token, **(env or {}))
        self.procs: list[ServiceProc] = []

    def start(self, name: str, args: list[str], env: dict | None = None, model: str | None = SAME,
              port: int | None = None, on=None) -> ServiceProc:  # fmt: skip
        """``model``: the Services' model by default; None: no --model (a standby node); ``port``: a free one;
        ``on``: a host to run on (its ``argv`` prefix and ``address``: a test's network namespace), else loopback."""
        port = port or free_port()
        model = self.model if model is SAME else model
        host = on.address if on is not None else "127.0.0.1"
        cmd = [*(on.argv if on is not None else []), sys.executable, "-m", "autoscaler.cli", *args, "--port", str(port)]
        if on is not None:
            cmd += ["--host", host]
        if model:
            cmd += ["--model", model]
        for url in self.store:
            cmd += ["--store", url]
        p = ServiceProc(f"{name}-{port}", cmd, f"http://{host}:{port}", self.log_dir,
                        {**self.env, **(env or {})}, self.auth)  # fmt: skip
        self.procs.append(p)
        return p

    def node(self, role: str, threads: int = 1, transport: str = "tcp", kv_blocks: int = 1024,
             extra: tuple[str, ...] = (), model: str | None = SAME, port: int | None = None, on=None
             ) -> ServiceProc:  # fmt: skip
        """A node of ``role`` loading ``model`` at start (default: the Services' model); ``model=None``: a
        standby node (no model; loads on demand through /internal/models/load)."""
        return self.start(role, ["node", "--role", role, "--threads", str(threads), "--kv-transport", transport,
                                 "--kv-blocks", str(kv_blocks), "--log-level", "warning", *extra], model=model,
                          port=port, on=on)  # fmt: skip

    def gateway(self, nodes: list[tuple[str, ServiceProc]], extra: tuple[str, ...] = (),
                env: dict | None = None, on=None) -> ServiceProc:  # fmt: skip
        args = ["gateway", "--log-level", "warning", *extra]
        for role, n in nodes:
            args += ["--node", f"{role}={n.url}"]
        p = self.start("gateway", args, {"PDSERVE_ADMIN_KEY": self.admin_key, **(env or {})}, on=on)
        p.admin_headers = self.admin_headers
        return p

    def stop(self, procs: list[ServiceProc]) -> None:
        for p in procs:
            try:
                p.stop()
            finally:
                if p in self.procs:
                    self.procs.remove(p)

    def stop_all(self) -> None:
        self.stop(list(self.procs))
