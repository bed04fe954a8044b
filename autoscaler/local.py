"""The local actuator: `pdserve node` processes on this machine (what `pdserve up` runs), supervised.

Lifecycle of one local node:
 1. ``scale`` up -> ``start``: a free port is picked, ``pdserve node --role R`` is spawned with
    the internal token in its environment (with ``--model M`` when the config names one; without, a
    *standby* runtime the warm pool, autoscaler/pool.py, injects models into; ``--import-nice``
    lets its imports yield the CPU to the nodes that serve) and its output in ``<log_dir>/<role>-<port>.log``;
    the node is tied to this process (compute/node/lifeline.py: it ends when we end, even on
    SIGKILL), so every spawn happens on one long-lived thread (the parent-death signal follows
    the thread that forked); it gets a process group of its own (a terminal's Ctrl-C reaches only us:
    we drain it) but stays in our session, so in our scheduler autogroup: a refill's niced imports
    yield the CPU to the serving nodes (a session of its own would be an autogroup of its own, weighed
    the same as a serving node whatever its nice);
 2. a watcher thread polls ``/ready`` (weights are injected lazily; seconds) and calls
    ``on_ready(NodeInfo)`` — the gateway registers it and starts routing to it; a node not
    ready after ``ready_timeout_s`` is killed (and counts as a crash, below);
 3. ``scale`` down -> the nodes named in ``prefer_remove`` first (the pool's standby runtimes),
    then the newest of the role, are drained: ``on_draining`` tells the gateway
    to route nothing new to it, ``POST /internal/drain`` makes it refuse new work (in case) and
    returns once its requests are finished; then ``on_gone`` deregisters it, SIGTERM, and
    SIGKILL after ``stop_timeout_s``;
 4. a node that exits on its own is restarted, like the kubelet restarts a container: each node
    has a slot (``decode-0``) that lives across its restarts; a thread blocked in waitpid for each node
    reaps its exit at once (``on_gone``: ``pdserve up`` also wakes the control loop, so the pool claims a
    standby for its models that tick), keeps the log's last lines, and the supervisor starts the slot
    again (without ``--import-nice``: a replacement restores what ran) after a
    ``RestartBackoff`` delay (1 s, 2 s, 4 s ... capped; forgotten once a restart has stayed ready
    for ``restart_reset_s``) — as long as the role still wants that many nodes (``scale`` sets
    the count; nodes made by a bare ``start`` are not replaced). ``status()`` shows the slots and
    their crash loops for `pdserve status`;
 5. ``close`` stops everything: drain (bounded), SIGTERM, SIGKILL after ``stop_timeout_s``
    (at once after ``hurry()``), and says which nodes it stopped.

A slot and its node's state live in ``autoscaler.local_node``; this module owns their threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from compute.node.client import NodeFailed, RequestRejected, SyncNodeClient
from compute.node.launcher import free_port
from compute.node.lifeline import spawn_kwargs

from .actuator import Actuator, NodeInfo, TemporaryActuatorError
from .backoff import Backoff, RestartBackoff
from .capacity import CapacityBound, CpuMeter, Machine, machine, machine_bound, rss_bytes
from .local_node import LocalNode, Slot, describe_exit, log_tail, send_signal, slot_row

log = logging.getLogger("pdserve.autoscaler")


@dataclass(slots=True)
class LocalConfig:
    """How local nodes are started and supervised."""

    model: str | None = None  # paramstore reference the nodes load at start; None: standby runtimes (the pool's)
    store: list[str] = field(default_factory=list)  # store locations (empty: the local default)
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    host: str = "127.0.0.1"
    kv_transport: str = "tcp"  # nixl | tcp
    weights: str = "int8"
    threads: int = 1  # torch threads per node
    kv_blocks: int = 1024
    log_dir: str = ".pdserve/logs"
    cache_dir: str | None = None  # node-local shard cache shared by the local nodes
    ready_timeout_s: float = 120.0  # a node not ready by then is killed (and restarted, backing off)
    drain_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    extra_args: tuple[str, ...] = ()
    import_nice: int = 0  # > 0: nodes do their heavy imports niced by this much (--import-nice; pool refills)
    restart_backoff_s: float = 1.0  # first restart of a node that exited on its own, then doubling
    restart_backoff_max_s: float = 60.0  # cap of the restart delay
    restart_reset_s: float = 60.0  # a restart ready this long ends the crash loop (delays start again at 1 s)
    supervise_interval_s: float = 0.25  # how often the supervisor looks for exits and due restarts
    cores: float = 0.0  # cores the nodes may use (capacity bound, autoscaler/capacity.py); 0 = this machine's
    #   (affinity, cgroup quota). Set it below the machine's to leave cores to something else

    def __post_init__(self) -> None:
        if self.threads < 0 or self.kv_blocks < 1 or self.ready_timeout_s <= 0:
            raise ValueError("threads >= 0, kv_blocks >= 1, ready_timeout_s > 0")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s or self.restart_reset_s <= 0:
            raise ValueError("0 <= restart_backoff_s <= restart_backoff_max_s, restart_reset_s > 0")
        if self.supervise_interval_s <= 0 or self.stop_timeout_s < 0:
            raise ValueError("supervise_interval_s > 0, stop_timeout_s >= 0")
        if self.cores < 0:
            raise ValueError(f"cores={self.cores} must be >= 0 (0: this machine's)")
        if not 0 <= self.import_nice <= 19:
            raise ValueError(f"import_nice={self.import_nice} must be in 0..19")


class LocalActuator(Actuator):
    def __init__(self, config: LocalConfig | None = None, on_ready: Callable[[NodeInfo], None] | None = None,
                 on_gone: Callable[[NodeInfo], None] | None = None,
                 on_draining: Callable[[NodeInfo], None] | None = None, **kw):  # fmt: skip
        self.config = config or LocalConfig(**kw)
        self.on_ready, self.on_gone, self.on_draining = on_ready, on_gone, on_draining
        self.nodes: list[LocalNode] = []
        self._desired: dict[str, int] = {}  # role -> nodes asked for by scale()
        self._waiting: list[Slot] = []  # slots whose node exited, waiting for their restart time
        self._names: dict[str, itertools.count] = {}  # role -> slot numbers: decode-0, decode-1 ...
        self._lock = threading.Lock()  # nodes, _desired, _waiting
        self._converge = threading.Lock()  # one scale() or supervision pass at a time (no double starts)
        self._closing, self._hurry = threading.Event(), threading.Event()
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="pdserve-spawn")  # the nodes' parent thread
        self._supervisor: threading.Thread | None = None
        self._cpu = CpuMeter(window_s=1.0)
        os.makedirs(self.config.log_dir, exist_ok=True)

    # --- the contract ----------------------------------------------------------------
    def current(self) -> dict[str, list[NodeInfo]]:
        with self._lock:
            self._reap(time.monotonic())
            out: dict[str, list[NodeInfo]] = {}
            for p in self.nodes:
                if p.state != "stopping":
                    out.setdefault(p.role, []).append(p.info())
            return out

    def replicas(self, role: str) -> int:
        """Nodes asked for (running, starting, or waiting to be restarted)."""
        with self._lock:
            if role in self._desired:
                return self._desired[role]
            return sum(1 for p in self.nodes if p.role == role and p.state != "stopping")

    def scale(self, role: str, replicas: int, prefer_remove: tuple[str, ...] = ()) -> None:
        """`replicas` nodes of `role`; fewer: the nodes whose URL is in `prefer_remove` leave first (in its
        order), then the newest."""
        order = {u: i for i, u in enumerate(prefer_remove)}
        with self._converge:
            with self._lock:
                self._desired[role] = replicas
                live = [p for p in self.nodes if p.role == role and p.state != "stopping"]
                waiting = [s for s in self._waiting if s.role == role]
                excess = len(live) + len(waiting) - replicas
                for s in waiting[::-1][: max(0, excess)]:  # fewer wanted: forget pending restarts first
                    self._waiting.remove(s)
                    excess -= 1
                live.sort(key=lambda p: p.started, reverse=True)
                live.sort(key=lambda p: order.get(p.url, len(order)))  # stable: newest first among the rest
                leaving = live[: max(0, excess)]
                for p in leaving:
                    p.state = "stopping"
                missing = replicas - len(live) - len(waiting)
            for _ in range(missing):
                self.start(role)
        for p in leaving:
            threading.Thread(target=self.stop, args=(p,), name=f"drain-{p.port}", daemon=True).start()

    def capacity(self, serving: tuple[str, ...] | None = None) -> tuple[CapacityBound, ...]:
        """The machine's bound on serving nodes (autoscaler/capacity.py): its cores (or ``cores``) and memory,
        its busy cores over the last second (every process's), ``threads`` per node. ``serving``:
        the URLs of the nodes that hold a model (the pool knows); None: every node not stopping."""
        with self._lock:
            live = [p for p in self.nodes if p.proc.poll() is None]
        m = machine()
        if self.config.cores:  # cores set: in place of the machine's own
            m = Machine(cores=self.config.cores, memory_bytes=m.memory_bytes, affinity=m.affinity, quota=None)
        busy = self._cpu.sample(quota=bool(m.quota))
        mine = [p for p in live if p.state != "stopping" and (serving is None or p.url in serving)]
        node_bytes = max((rss_bytes(p.proc.pid) for p in mine if p.ready), default=0)
        return (machine_bound(m, self.config.threads or 1, len(mine), busy, node_bytes),)

    def prepare(self, role: str, replicas: int) -> None:
        """Warm the model's shards into the shared node cache before nodes start (standby runtimes: nothing)."""
        if not self.config.cache_dir or not self.config.model:
            return
        from paramstore import ParamStore, StoreConfig
        from paramstore.cache import CacheConfig, NodeCache

        cfg = StoreConfig(locations=self.config.store) if self.config.store else StoreConfig.local_default()
        with ParamStore(cfg) as store:
            store.warm(self.config.model, NodeCache(CacheConfig(dir=self.config.cache_dir, disk_bytes=16 << 30,
                                                                 memory_bytes=0)))  # fmt: skip

    def close(self, drain_s: float = 0.0) -> list[str]:
        """Stop every node: drain the ready ones at once (bounded by drain_s), SIGTERM, SIGKILL after
        stop_timeout_s (at once after hurry()). Returns them in words ("decode pid 123"), in start order."""
        self._closing.set()
        if self._supervisor is not None:
            self._supervisor.join(5.0)
        with self._converge, self._lock:  # a scale() in progress finishes its starts first
            procs = list(self.nodes)
            self._waiting.clear()
            self._desired.clear()
        for p in procs:
            p.state = "stopping"
        if drain_s > 0:
            self._drain_all([p for p in procs if p.ready and p.proc.poll() is None], drain_s)
        for p in procs:
            send_signal(p.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        killed = {id(p) for p in procs if not self._wait(p.proc, deadline)}
        for p in procs:
            if id(p) in killed:
                send_signal(p.proc, signal.SIGKILL)
                p.proc.wait(5)
        with self._lock:
            self.nodes.clear()
        self._spawner.shutdown(wait=False)
        return [f"{p.role} pid {p.proc.pid}" + (" (killed)" if id(p) in killed else "") for p in procs]

    def hurry(self) -> None:
        """Make a close() in progress stop waiting: no more drain, SIGKILL what SIGTERM has not ended."""
        self._hurry.set()

    def status(self) -> dict:
        """The supervised slots for `pdserve status`: each one's node (pid, url, state) or pending restart
        (restart_in_s), its restarts, its crash count, how its last node ended and that node's last log lines."""
        now = time.monotonic()
        rows = []
        with self._lock:
            for p in self.nodes:
                rows.append(slot_row(p.slot, p.state, p.proc.pid, p.url, now))
            for s in self._waiting:
                rows.append(slot_row(s, "crash-loop" if s.backoff.repeated else "restarting", None, "", now))
            desired = dict(self._desired)
        return {"desired": desired, "nodes": sorted(rows, key=lambda r: (r["role"], r["slot"]))}

    # --- supervision --------------------------------------------------------------------
    def reconcile(self) -> None:
        """One supervision pass: reap nodes that exited on their own, forget crash loops that have
        healed, start the slots whose restart time has come."""
        with self._converge:
            now = time.monotonic()
            with self._lock:
                if self._closing.is_set():
                    return
                self._reap(now)
                for p in self.nodes:
                    if p.state == "ready" and p.ready_at is not None:
                        p.slot.backoff.healthy(p.ready_at, now)
                due = [s for s in self._waiting if s.backoff.ready(now)]
                for s in due:
                    self._waiting.remove(s)
            for s in due:
                try:
                    self.start(s.role, s)
                except TemporaryActuatorError as e:
                    with self._lock:
                        s.backoff.failure(now, e)
                        self._waiting.append(s)

    def _reap(self, now: float) -> None:
        """(holding _lock) Nodes that exited on their own: deregistered; their slot waits for a restart
        if the role still wants it."""
        for p in [p for p in self.nodes if p.proc.poll() is not None and p.state != "stopping"]:
            self.nodes.remove(p)
            s = p.slot
            s.last_exit, s.last_log = p.why or describe_exit(p.proc.returncode), log_tail(p.log_path)
            have = sum(1 for q in self.nodes if q.role == p.role and q.state != "stopping")
            have += sum(1 for w in self._waiting if w.role == p.role)
            if have < self._desired.get(p.role, 0):
                delay = s.backoff.failure(now, s.last_exit)
                self._waiting.append(s)
                log.warning("%s node %s (%s, pid %d) %s: restarting in %.1f s (%d exits in a row)", p.role, p.url,
                            s.name, p.proc.pid, s.last_exit, delay, s.backoff.failures)  # fmt: skip
            else:
                log.warning("%s node %s (pid %d) %s", p.role, p.url, p.proc.pid, s.last_exit)
            self._hook(self.on_gone, p)

    def _exited(self, p: LocalNode) -> None:
        """Block in waitpid until the node ends; one that ended on its own is reaped at once (on_gone: the
        gateway stops routing to it, the pool places its models again) — not at the next supervision pass."""
        p.proc.wait()
        with self._lock:
            if not self._closing.is_set() and p in self.nodes:
                self._reap(time.monotonic())

    def _supervise(self) -> None:
        while not self._closing.wait(self.config.supervise_interval_s):  # until close()
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - the next pass tries again
                log.exception("supervision pass failed")

    # --- process management ------------------------------------------------------------
    def start(self, role: str, slot: Slot | None = None) -> LocalNode:
        """Spawn one node of `role` (in `slot` when restarting one; a new slot otherwise)."""
        c = self.config
        if self._closing.is_set():
            raise TemporaryActuatorError("the local actuator is closing")
        restart = slot is not None
        if slot is None:
            backoff = Backoff(base_s=c.restart_backoff_s, max_s=c.restart_backoff_max_s)
            n = next(self._names.setdefault(role, itertools.count()))
            slot = Slot(f"{role}-{n}", role, RestartBackoff(backoff, reset_after_s=c.restart_reset_s))
        else:
            slot.backoff.started()
        port = free_port(c.host)
        cmd = [sys.executable, "-m", "autoscaler.cli", "node", "--role", role, "--host", c.host, "--port", str(port),
               "--weights", c.weights, "--kv-blocks", str(c.kv_blocks), "--kv-transport", c.kv_transport,
               "--threads", str(c.threads), *c.extra_args]  # fmt: skip
        # a runtime without a model starts empty even when the shared config file sets [node] model
        cmd += ["--model", c.model] if c.model else ["--standby"]
        if c.import_nice and not restart:  # a dead node's replacement restores what ran: it does not yield
            cmd += ["--import-nice", str(c.import_nice)]
        for url in c.store:
            cmd += ["--store", url]
        if c.cache_dir:
            cmd += ["--cache-dir", c.cache_dir]
        kw = spawn_kwargs(dict(os.environ, PDSERVE_INTERNAL_TOKEN=c.internal_token, PYTHONUNBUFFERED="1"),
                          pdeathsig=True)  # the spawner thread lives until close()  # fmt: skip
        log_path = os.path.join(c.log_dir, f"{role}-{port}.log")
        logf = open(log_path, "ab")
        try:
            proc = self._spawner.submit(subprocess.Popen, cmd, stdout=logf, stderr=subprocess.STDOUT,
                                        process_group=0, **kw).result()  # fmt: skip
        except (OSError, RuntimeError) as e:  # RuntimeError: the spawner is shut down (closing)
            raise TemporaryActuatorError(f"cannot start a {role} node: {e}") from None
        finally:
            logf.close()
        p = LocalNode(role, port, proc, f"http://{c.host}:{port}", slot, log_path)
        with self._lock:
            self.nodes.append(p)
            if self._supervisor is None and not self._closing.is_set():
                self._supervisor = threading.Thread(target=self._supervise, name="pdserve-supervise", daemon=True)
                self._supervisor.start()
        threading.Thread(target=self._watch, args=(p,), name=f"watch-{port}", daemon=True).start()
        threading.Thread(target=self._exited, args=(p,), name=f"wait-{port}", daemon=True).start()
        log.info("started %s node %s pid %d on %s", role, slot.name, proc.pid, p.url)
        return p

    def _watch(self, p: LocalNode) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        with SyncNodeClient(None, timeout_s=2.0) as client:  # /ready is open
            while time.monotonic() < deadline and p.proc.poll() is None and p.state != "stopping":
                if client.ready(p.url):
                    p.ready, p.state, p.ready_at = True, "ready", time.monotonic()
                    log.info("%s node %s ready in %.1f s", p.role, p.url, p.ready_at - p.started)
                    if self.on_ready:
                        self.on_ready(p.info())
                    return
                time.sleep(0.1)
        if not p.ready and p.state != "stopping" and p.proc.poll() is None:
            log.error("%s node %s not ready after %.0f s: killing it", p.role, p.url, self.config.ready_timeout_s)
            p.why = f"not ready after {self.config.ready_timeout_s:g} s"
            send_signal(p.proc, signal.SIGKILL)  # reaped by the supervisor: a crash of its slot

    def stop(self, p: LocalNode) -> None:
        """Drain (bounded), deregister, SIGTERM, SIGKILL after the stop timeout."""
        p.state = "stopping"
        if p.proc.poll() is None and p.ready:
            self._hook(self.on_draining, p)
            self._drain(p, self.config.drain_timeout_s)
        self._hook(self.on_gone, p)
        send_signal(p.proc, signal.SIGTERM)
        if not self._wait(p.proc, time.monotonic() + self.config.stop_timeout_s):
            send_signal(p.proc, signal.SIGKILL)
            p.proc.wait(5)
        with self._lock:
            if p in self.nodes:
                self.nodes.remove(p)
        log.info("stopped %s node %s", p.role, p.url)

    def _drain(self, p: LocalNode, timeout: float) -> None:
        try:
            with SyncNodeClient(self.config.internal_token) as client:
                client.drain(p.url, timeout)
        except (httpx.HTTPError, NodeFailed, RequestRejected) as e:
            log.warning("drain of %s failed: %s", p.url, e)

    def _drain_all(self, procs: list[LocalNode], timeout: float) -> None:
        """Drain these nodes in parallel; back after all are drained, `timeout` or hurry(), whichever first."""
        threads = [threading.Thread(target=self._drain, args=(p, timeout), daemon=True) for p in procs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline and not self._hurry.is_set():
            self._hurry.wait(0.05)

    def _wait(self, proc: subprocess.Popen, deadline: float) -> bool:
        """Wait until the process ends, `deadline` passes or hurry(); True if it ended."""
        while proc.poll() is None and time.monotonic() < deadline and not self._hurry.is_set():
            self._hurry.wait(0.05)
        return proc.poll() is not None

    def _hook(self, fn: Callable[[NodeInfo], None] | None, p: LocalNode) -> None:
        if fn:
            try:
                fn(p.info())
            except Exception:  # noqa: BLE001 - (de)registration is best effort
                log.exception("%s for %s", fn, p.url)
