"""The local actuator: `pdserve node` processes on this machine (what `pdserve up` runs).

Lifecycle of one local node:
 1. ``scale`` up -> ``start``: a free port is picked, ``pdserve node --role R`` is spawned with
    the internal token in its environment and its output in ``<log_dir>/<role>-<port>.log``;
 2. a watcher thread polls ``/ready`` (weights are injected lazily; seconds) and calls
    ``on_ready(NodeInfo)`` — the gateway registers it and starts routing to it;
 3. ``scale`` down -> the newest node of the role is drained: ``on_draining`` tells the gateway
    to route nothing new to it, ``POST /internal/drain`` makes it refuse new work (in case) and
    returns once its requests are finished; then ``on_gone`` deregisters it, SIGTERM, and
    SIGKILL after ``stop_timeout_s``;
 4. a node process that dies on its own is reported not ready and dropped at the next
    ``current()``; the control loop starts a replacement if the policy still wants one.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .actuator import Actuator, NodeInfo, TemporaryActuatorError

log = logging.getLogger("pdserve.autoscaler")


@dataclass(slots=True)
class LocalConfig:
    """How local nodes are started."""

    model: str = "smollm2"  # paramstore reference the nodes serve
    store: list[str] = field(default_factory=list)  # store locations (empty: the local default)
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    host: str = "127.0.0.1"
    kv_transport: str = "tcp"  # nixl | tcp
    weights: str = "int8"
    threads: int = 1  # torch threads per node
    kv_blocks: int = 1024
    log_dir: str = ".pdserve/logs"
    cache_dir: str | None = None  # node-local shard cache shared by the local nodes
    ready_timeout_s: float = 120.0  # a node not ready by then is killed and reported
    drain_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.threads < 0 or self.kv_blocks < 1 or self.ready_timeout_s <= 0:
            raise ValueError("threads >= 0, kv_blocks >= 1, ready_timeout_s > 0")


@dataclass(slots=True)
class _Proc:
    role: str
    port: int
    proc: subprocess.Popen
    url: str
    ready: bool = False
    state: str = "loading"
    started: float = field(default_factory=time.monotonic)

    def info(self) -> NodeInfo:
        return NodeInfo(self.role, self.url, self.ready, name=f"pid {self.proc.pid}", state=self.state)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalActuator(Actuator):
    def __init__(self, config: LocalConfig | None = None, on_ready: Callable[[NodeInfo], None] | None = None,
                 on_gone: Callable[[NodeInfo], None] | None = None,
                 on_draining: Callable[[NodeInfo], None] | None = None, **kw):  # fmt: skip
        self.config = config or LocalConfig(**kw)
        self.on_ready, self.on_gone, self.on_draining = on_ready, on_gone, on_draining
        self.nodes: list[_Proc] = []
        self._lock = threading.Lock()
        self._headers = {"Authorization": f"Bearer {self.config.internal_token}"}
        os.makedirs(self.config.log_dir, exist_ok=True)

    # --- the contract ----------------------------------------------------------------
    def current(self) -> dict[str, list[NodeInfo]]:
        with self._lock:
            for p in [p for p in self.nodes if p.proc.poll() is not None and p.state != "stopping"]:
                log.warning("node %s (%s) exited with %s", p.url, p.role, p.proc.returncode)
                self.nodes.remove(p)
                self._gone(p)
            out: dict[str, list[NodeInfo]] = {}
            for p in self.nodes:
                if p.state != "stopping":
                    out.setdefault(p.role, []).append(p.info())
            return out

    def scale(self, role: str, replicas: int) -> None:
        with self._lock:
            live = [p for p in self.nodes if p.role == role and p.state != "stopping"]
        for _ in range(replicas - len(live)):
            self.start(role)
        for p in sorted(live, key=lambda p: p.started, reverse=True)[: max(0, len(live) - replicas)]:
            p.state = "stopping"
            threading.Thread(target=self.stop, args=(p,), name=f"drain-{p.port}", daemon=True).start()

    def prepare(self, role: str, replicas: int) -> None:
        """Warm the model's shards into the shared node cache before nodes start."""
        if not self.config.cache_dir:
            return
        from paramstore import ParamStore, StoreConfig
        from paramstore.cache import CacheConfig, NodeCache

        cfg = StoreConfig(locations=self.config.store) if self.config.store else StoreConfig.local_default()
        with ParamStore(cfg) as store:
            store.warm(self.config.model, NodeCache(CacheConfig(dir=self.config.cache_dir, disk_bytes=16 << 30,
                                                                 memory_bytes=0)))  # fmt: skip

    def close(self) -> None:
        with self._lock:
            procs = list(self.nodes)
        for p in procs:
            p.state = "stopping"
            _signal(p.proc, signal.SIGTERM)
        for p in procs:
            _wait_or_kill(p.proc, self.config.stop_timeout_s)
        with self._lock:
            self.nodes.clear()

    # --- process management ------------------------------------------------------------
    def start(self, role: str) -> _Proc:
        c = self.config
        port = free_port(c.host)
        cmd = [sys.executable, "-m", "autoscaler.cli", "node", "--role", role, "--model", c.model, "--host", c.host,
               "--port", str(port), "--weights", c.weights, "--kv-blocks", str(c.kv_blocks),
               "--kv-transport", c.kv_transport, "--threads", str(c.threads), *c.extra_args]  # fmt: skip
        for url in c.store:
            cmd += ["--store", url]
        if c.cache_dir:
            cmd += ["--cache-dir", c.cache_dir]
        env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=c.internal_token, PYTHONUNBUFFERED="1")
        logf = open(os.path.join(c.log_dir, f"{role}-{port}.log"), "ab")
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            raise TemporaryActuatorError(f"cannot start a {role} node: {e}") from None
        finally:
            logf.close()
        p = _Proc(role, port, proc, f"http://{c.host}:{port}")
        with self._lock:
            self.nodes.append(p)
        threading.Thread(target=self._watch, args=(p,), name=f"watch-{port}", daemon=True).start()
        log.info("started %s node pid %d on %s", role, proc.pid, p.url)
        return p

    def _watch(self, p: _Proc) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        with httpx.Client(headers=self._headers, timeout=2.0) as client:
            while time.monotonic() < deadline and p.proc.poll() is None and p.state != "stopping":
                try:
                    if client.get(p.url + "/ready").status_code == 200:
                        p.ready, p.state = True, "ready"
                        log.info("%s node %s ready in %.1f s", p.role, p.url, time.monotonic() - p.started)
                        if self.on_ready:
                            self.on_ready(p.info())
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        if not p.ready and p.state != "stopping":
            log.error("%s node %s not ready after %.0f s: stopping it", p.role, p.url, self.config.ready_timeout_s)
            p.state = "stopping"
            self.stop(p)

    def stop(self, p: _Proc) -> None:
        """Drain (bounded), deregister, SIGTERM, SIGKILL after the stop timeout."""
        p.state = "stopping"
        if p.proc.poll() is None and p.ready:
            self._hook(self.on_draining, p)
            try:
                httpx.post(p.url + "/internal/drain", params={"timeout_s": self.config.drain_timeout_s},
                           headers=self._headers, timeout=self.config.drain_timeout_s + 5)  # fmt: skip
            except httpx.HTTPError as e:
                log.warning("drain of %s failed: %s", p.url, e)
        self._gone(p)
        _signal(p.proc, signal.SIGTERM)
        _wait_or_kill(p.proc, self.config.stop_timeout_s)
        with self._lock:
            if p in self.nodes:
                self.nodes.remove(p)
        log.info("stopped %s node %s", p.role, p.url)

    def _gone(self, p: _Proc) -> None:
        self._hook(self.on_gone, p)

    def _hook(self, fn: Callable[[NodeInfo], None] | None, p: _Proc) -> None:
        if fn:
            try:
                fn(p.info())
            except Exception:  # noqa: BLE001 - (de)registration is best effort
                log.exception("%s for %s", fn, p.url)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
