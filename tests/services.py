"""Real processes for end-to-end tests: nodes and gateways on 127.0.0.1, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

TOKEN = "test-internal-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(**extra) -> dict:
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=TOKEN, PYTHONUNBUFFERED="1", UCX_NET_DEVICES="lo",
               NIXL_LOG_LEVEL="WARN", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    for k in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY"):
        env.pop(k, None)
    env.update(extra)
    return env


class Proc:
    """One started service process; ``stop`` (or the fixture) ends it."""

    def __init__(self, cmd: list[str], url: str, log_path: str, env: dict):
        self.url, self.log_path = url, log_path
        self._log = open(log_path, "wb")
        self.p = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0, path: str = "/ready") -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.p.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + path, headers=HEADERS, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready in {timeout} s: {self.log()[-2000:]}")

    def load(self) -> dict:
        return httpx.get(self.url + "/load", headers=HEADERS, timeout=5).json()

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


def start_node(tmp, store: list[str], model: str, role: str, transport: str = "tcp", threads: int = 1,
               extra: tuple[str, ...] = ()) -> Proc:  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "compute.cli", "node", "--role", role, "--model", model, "--port", str(port),
           "--kv-transport", transport, "--threads", str(threads), "--kv-blocks", "512", *extra]  # fmt: skip
    for url in store:
        cmd += ["--store", url]
    return Proc(cmd, f"http://127.0.0.1:{port}", str(tmp / f"{role}-{port}.log"), service_env())


def start_gateway(tmp, store: list[str], model: str, nodes: list[tuple[str, Proc]], extra: tuple[str, ...] = (),
                  env: dict | None = None) -> Proc:  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "compute.cli", "gateway", "--model", model, "--port", str(port), *extra]
    for url in store:
        cmd += ["--store", url]
    for role, n in nodes:
        cmd += ["--node", f"{role}={n.url}"]
    return Proc(cmd, f"http://127.0.0.1:{port}", str(tmp / f"gateway-{port}.log"), service_env(**(env or {})))


def wait_blocks_free(nodes: list[Proc], timeout: float = 10.0) -> list[dict]:
    """Poll until every node reports no used/held KV blocks and no active requests (or time out)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [n.load() for n in nodes]
        if all(ld["kv_blocks_used"] == 0 and ld["active_requests"] == 0 for ld in loads):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.1)
