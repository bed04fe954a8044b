"""A model's compiled decode steps taken off the request path: this machine's file, else the store's, else built.

Lifecycle of one model's graphs on one node (``compute/node/held.py`` starts it once the model is ready; the
pipeline is ``compute.kernels.artefacts``', shared with the kernel plans):
 1. a ``GraphBuilder`` thread (niced) waits for the model's final kernel plan (a measurement in progress ends
    first), then, for every range of batch sizes over which each linear runs the same kernel
    (``step_graphs.ranges``), takes the graph's package: this machine's file (``<cache_dir>/graphs/<id>.pt2``),
    else — under the machine's lock on it (``<cache_dir>/graphs/.<id>.lock``: one process of the machine takes it,
    the others poll for its file) — the store's (``store.graphs``), else one built in a builder process
    (``graph_process``: ``torch.export`` + AOTInductor, without the weights, niced, its own process group killed
    at stop: ~1 min a range for SmolLM2 on 2 cores) and published, so that no other node of this class compiles;
 2. a package is loaded (``step_graphs.load_package``: dlopen, no compile) with the model's own tensors bound and
    handed to ``install``, which posts it to the engine thread: it installs it only if the model still runs the
    kernels it was built for (else ``again``: a plan swap came first);
 3. ``again`` (a plan swap) takes them again; ``stop`` ends the thread and kills a build in progress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from compute.engine.step_graphs import Graph, StepGraphs, graph_id, load_package, ranges, spec
from compute.kernels import artefacts, int8
from compute.modeling.graph_step import GraphStep
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from compute.node import graph_process

log = logging.getLogger("pdserve.node")
SOURCES = {"cached": "local", "peer": "local", "store": "store", "built": "built"}  # ``take``'s word -> ours


class GraphBuilder(artefacts.Builder):
    """Takes (loads, fetches or builds) a model's graphs off the request path and hands them to ``install``."""

    def __init__(self, model: Transformer, cache: KVCache, max_streams: int, *, store=None, cache_dir: str | None,
                 model_key: str, plan_final: Callable[[float], bool], install: Callable[[Graph], None],
                 name: str = "", poll_s: float = 1.0) -> None:  # fmt: skip
        """``plan_final(timeout)``: True once the model's kernel plan will not change (a measurement ended);
        ``install(graph)``: hands a graph to the engine thread (which re-checks its spec)."""
        super().__init__(f"graphs-{name}")
        self.model, self.cache, self.max_streams, self.store = model, cache, max_streams, store
        self.dir = os.path.join(cache_dir, "graphs") if cache_dir else None
        self.model_key, self.plan_final, self.install, self.name = model_key, plan_final, install, name
        self.poll_s = poll_s  # while another process of this machine takes a package
        self.sources: dict[str, str] = {}  # graph id -> local | store | built, where this process first took it
        self._again = threading.Event()
        self._idle = False  # every graph of the current kernels taken (or given up)
        self._child = None  # the builder process of the package being built (``graph_process``)

    def start(self) -> GraphBuilder:
        self._again.set()
        return super().start()

    def state(self, graphs: StepGraphs | None) -> dict:
        """For /load: the installed batch ranges, where each package came from (local | store | built), steps run."""
        installed = list(graphs.graphs) if graphs is not None else []
        return {"installed": [[g.lo, g.hi] for g in sorted(installed, key=lambda g: g.lo)],
                "sources": dict(self.sources), "steps": graphs.steps if graphs is not None else 0,
                "idle": self._idle and (self._stop.is_set() or not self._again.is_set())}  # fmt: skip

    def again(self) -> None:
        """The kernels changed (a plan swap): take the graphs again."""
        self._again.set()

    def interrupt(self) -> None:
        """A build in progress is cut short: its process group (the builder process and every compiler it started)
        is killed at once."""
        self._again.set()
        child = self._child
        if child is not None:
            graph_process.kill(child)
            log.info("step graphs of %s: stopped mid-build (its builder process group killed)", self.name)

    def wait_idle(self, timeout: float) -> bool:
        """True once every graph of the current kernels has been taken (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._again.is_set() and self._idle:
                return True
            time.sleep(0.05)
        return False

    def run(self) -> None:
        while not self._stop.is_set():
            self._again.wait()
            if self._stop.is_set():
                return
            self._idle = False
            self._again.clear()
            while not self.plan_final(0.5):
                if self._stop.is_set():
                    return
            try:
                self._take_all()
            except graph_process.BuildStopped as e:
                log.info("step graphs of %s: %s", self.name, e)
            except Exception as e:  # noqa: BLE001 - the node serves eagerly; one log line
                log.error("step graphs of %s not taken: %s: %s (serving eagerly)", self.name, type(e).__name__, e)
            self._idle = True

    def _take_all(self) -> None:
        mk = int8.machine_key(torch.get_num_threads())
        for lo, hi in ranges(self.model, self.max_streams):
            if self._stop.is_set() or self._again.is_set():
                return
            try:
                sp = spec(self.model, lo, hi, self.cache)
            except ValueError as e:  # a kernel the graph does not run (e.g. dequant): this range stays eager
                log.warning("no step graph for batch %d-%d of %s: %s", lo, hi, self.name, e)
                continue
            gid = graph_id(mk, self.model_key, sp)
            step = GraphStep(self.model, lo)
            t0 = time.perf_counter()
            path, source = self._package(gid, lo, hi, sp, mk)
            fn = load_package(path, step)
            self.sources.setdefault(gid, source)  # where it came from first: a re-take after a swap finds it here
            log.info("step graph %s (%s, batch %d-%d) %s, loaded in %.2f s", gid, self.name, lo, hi,
                     {"local": "from this machine", "store": "from the store", "built": "built"}[source],
                     time.perf_counter() - t0)  # fmt: skip
            self.install(Graph(lo, hi, sp["max_keys"], step, fn, gid))

    def _package(self, gid: str, lo: int, hi: int, sp: dict, mk: str) -> tuple[str, str]:
        """(path of the package's file, where it came from): ``artefacts.Builder.take`` with this machine's file."""
        local = os.path.join(self.dir, f"{gid}.pt2") if self.dir else None
        tmpdir = self.dir or tempfile.gettempdir()
        os.makedirs(tmpdir, exist_ok=True)

        def cached() -> str | None:
            return local if local and os.path.exists(local) else None

        def fetch() -> str | None:
            data = None
            if self.store is not None and hasattr(self.store, "graphs"):
                data = artefacts.fetch("step graph", gid, lambda: self.store.graphs.get(gid)[1])
            return None if data is None else self._save(data, local, gid)

        path, how = self.take(cached, os.path.join(tmpdir, f".{gid}.lock"), fetch,
                              lambda: self._build(gid, lo, hi, sp, mk, local, tmpdir), self.poll_s)  # fmt: skip
        if path is None:
            raise graph_process.BuildStopped(f"step graph {gid} not taken: stopped")
        return path, SOURCES[how]

    def _build(self, gid: str, lo: int, hi: int, sp: dict, mk: str, local: str | None, tmpdir: str) -> str:
        t0 = time.perf_counter()
        log.info("step graph %s (%s, batch %d-%d): none in the store for this machine class, building it",
                 gid, self.name, lo, hi)  # fmt: skip
        graph_process.sweep(tmpdir)
        tmp = graph_process.partial_path(tmpdir, gid)  # a killed build leaves it: swept
        try:
            graph_process.build(sp, lo, hi, tmp, self._stop, on_start=self._started)
            with open(tmp, "rb") as f:
                data = f.read()
        finally:
            self._child = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        log.info("step graph %s built in %.1f s (%.1f MiB)", gid, time.perf_counter() - t0, len(data) / 2**20)
        if self.store is not None and hasattr(self.store, "graphs"):
            meta = {"machine_key": mk, "model": self.model_key, "spec": sp}
            if artefacts.publish(self.store.graphs, "step graph", gid, lambda: self.store.graphs.publish(gid, meta, data)):
                log.info("step graph %s published to the store", gid)
        return self._save(data, local, gid)

    def _started(self, child) -> None:
        self._child = child
        if self._stop.is_set():  # a stop between the check and the start
            graph_process.kill(child)

    def _save(self, data: bytes, local: str | None, gid: str) -> str:
        path = local or os.path.join(tempfile.gettempdir(), f"pdserve-graph-{os.getpid()}-{gid}.pt2")
        tmp = graph_process.partial_path(os.path.dirname(path), gid)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # never a half-written package under its name
        return path
