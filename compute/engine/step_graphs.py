"""The decode step compiled ahead of time, per range of batch sizes: which graphs, where they come from, the swap.

Lifecycle of one model's graphs on one node (``[node] step = "graph"``, the default on the CPU):
 1. the node serves eagerly from ready: nothing is compiled on the request path;
 2. a ``GraphBuilder`` thread waits for the model's final kernel plan (a measurement in progress ends first), then,
    for every range of batch sizes over which each linear runs the same kernel (``ranges``), takes the graph's
    package: this machine's file (``<cache_dir>/graphs/<id>.pt2``), else the store's (``store.graphs``), else it
    builds one in a builder process (``compute.engine.graph_build``: ``torch.export`` + AOTInductor, without the
    weights, niced, its own process group killed at stop: ~1 min a range for SmolLM2 on 2 cores) and publishes it,
    so that no other node of this machine class compiles;
 3. a package is loaded (dlopen: no compile) with the model's own tensors bound as its constants (no copy) and
    posted to the engine thread, which installs it only if the model still runs the kernels it was built for;
 4. ``StepGraphs.decode`` runs a pure-decode batch whose size an installed graph covers; prefill, mixed batches,
    prompt logprobs and uncovered sizes stay eager. A kernel-plan swap drops every graph and the builder re-runs.

A package's id: sha256 of the machine key, the graph's spec (kernel per linear, every bound tensor's name, shape
and dtype, dims, batch range, KV dtype; not the weights' values: models of one architecture share packages) and
the source of ``compute/modeling/graph_step.py``: 16 hex digits. The graph only reads the KV cache;
``GraphStep.write`` stores the step's K/V after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compute.engine import graph_build
from compute.kernels import int4, int8, native
from compute.modeling.graph_step import GraphStep, step_inputs
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer

log = logging.getLogger("pdserve.node")
NICE = 19  # the builder thread's niceness (and its compiler's): serving threads come first
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "modeling", "graph_step.py")


@dataclass(slots=True)
class Graph:
    """One installed graph: batch sizes ``lo..hi``, keys up to ``max_keys``; ``fn`` the loaded package."""

    lo: int
    hi: int
    max_keys: int
    step: GraphStep
    fn: Callable
    gid: str


def ranges(model: Transformer, max_streams: int) -> list[tuple[int, int]]:
    """Batch sizes 1..max_streams cut where a linear's kernel changes; size 1 alone (``torch.export`` takes a
    dynamic size of 1 as a constant)."""
    out: list[tuple[int, int]] = []
    last = None
    for m in range(1, max_streams + 1):
        kinds = GraphStep(model, m).kinds
        if m == 2 or kinds != last:
            out.append((m, m))
        else:
            out[-1] = (out[-1][0], m)
        last = kinds
    return out


def spec(model: Transformer, lo: int, hi: int, cache: KVCache) -> dict:
    """What a package depends on besides the machine and the model's weights (``graph_id``)."""
    c, step = model.config, GraphStep(model, lo)
    tensors = {k: [list(t.shape), str(t.dtype)] for k, t in step.named_buffers()}
    return {"batch": [lo, hi], "kinds": step.kinds, "tensors": tensors, "alias": step.alias,
            "absent": sorted(step.absent), "eps": c.rms_norm_eps, "kv_dtype": str(cache.dtype),
            "block_size": cache.block_size, "max_keys": max_keys(model, cache),
            "dims": [c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                     c.vocab_size]}  # fmt: skip


def max_keys(model: Transformer, cache: KVCache) -> int:
    bs = cache.block_size
    return -(-model.config.max_position_embeddings // bs) * bs


def graph_id(machine_key: str, model_key: str, sp: dict) -> str:
    with open(SOURCE, "rb") as f:
        code = hashlib.sha256(f.read()).hexdigest()
    raw = json.dumps({"machine": machine_key, "model": model_key, "spec": sp, "code": code}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


FOLDED = "_FOLDED_CONST_"  # a constant the package computes from the bound ones at load (runtime constant folding)


def load_package(path: str, step: GraphStep) -> Callable:
    """The package at ``path`` as a callable over ``step``'s tensors (bound by reference: no copy). Besides them it
    wants one 0-d int64 constant per int4 linear, named ``constantN`` by the compiler: the kernel's group size
    (``_weight_int4pack_mm_cpu_tensor`` takes it as a tensor); any other unknown constant refuses the package."""
    native.available()  # a package that runs the native kernel calls its registered op
    fn = torch._inductor.aoti_load_package(path)
    consts = dict(step.named_buffers())
    wanted = [n for n in fn.get_constant_fqns() if not n.startswith(FOLDED)]
    unknown = sorted(set(wanted) - set(consts))
    int4s = sum(k == "int4" for k in step.kinds.values())
    if unknown and (len(unknown) != int4s or not all(n.startswith("constant") for n in unknown)):
        raise ValueError(f"step graph package wants tensors this model does not have: {unknown[:3]}")
    group = torch.tensor(int4.GROUP, dtype=torch.int64)
    bound = {k: consts[k] for k in wanted if k in consts} | dict.fromkeys(unknown, group)
    fn.load_constants(bound, check_full_update=True, user_managed=True)
    return fn


def _sweep(folder: str) -> None:
    """Remove the partial files of builds whose process is gone (killed mid-build)."""
    for name in os.listdir(folder):
        parts = name.split(".")
        if name.startswith(".") and name.endswith(".building.pt2") and len(parts) == 5 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            except PermissionError:  # another user's live process
                pass


class StepGraphs:
    """The graphs installed on one engine (its thread only): ``decode`` a batch through one, else None."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.steps = 0  # decode steps run through a graph

    def install(self, g: Graph) -> None:
        self.graphs = [x for x in self.graphs if x.hi < g.lo or x.lo > g.hi] + [g]

    def clear(self) -> int:
        n, self.graphs = len(self.graphs), []
        return n

    def covers(self, b: int) -> Graph | None:
        return next((g for g in self.graphs if g.lo <= b <= g.hi), None)

    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]],
               cache: KVCache) -> torch.Tensor | None:  # fmt: skip
        """One decode token per sequence -> logits [B, V] fp32 and the cache written; None: no graph covers it."""
        g = self.covers(len(tokens))
        bs = cache.block_size
        n = -(-(max(positions) + 1) // bs) * bs
        if g is None or n > g.max_keys or n < 2:
            return None
        ids, pos, slots, ctx_slots, ctx_lens = step_inputs(tokens, positions, tables, bs, n)
        try:
            logits, fresh = g.fn(ids, pos, ctx_slots, ctx_lens, cache.kv)
        except Exception as e:  # noqa: BLE001 - the graph only read the cache: this step runs eagerly instead
            log.error("step graph %s (batch %d-%d) failed and is dropped, eager from now: %s: %s", g.gid, g.lo, g.hi,
                      type(e).__name__, e)  # fmt: skip
            self.graphs = [x for x in self.graphs if x is not g]
            return None
        g.step.write(cache.kv, slots, fresh)
        self.steps += 1
        return logits


class GraphBuilder:
    """Takes (loads, fetches or builds) a model's graphs off the request path and hands them to ``install``."""

    def __init__(self, model: Transformer, cache: KVCache, max_streams: int, *, store=None, cache_dir: str | None,
                 model_key: str, plan_final: Callable[[float], bool], install: Callable[[Graph], None],
                 name: str = "") -> None:  # fmt: skip
        """``plan_final(timeout)``: True once the model's kernel plan will not change (a measurement ended);
        ``install(graph)``: hands a graph to the engine thread (which re-checks its spec)."""
        self.model, self.cache, self.max_streams, self.store = model, cache, max_streams, store
        self.dir = os.path.join(cache_dir, "graphs") if cache_dir else None
        self.model_key, self.plan_final, self.install, self.name = model_key, plan_final, install, name
        self.sources: dict[str, str] = {}  # graph id -> local | store | built, where this process first took it
        self._stop, self._again = threading.Event(), threading.Event()
        self._idle = False  # every graph of the current kernels taken (or given up)
        self._thread: threading.Thread | None = None
        self._child = None  # the builder process of the package being built (``compute.engine.graph_build``)

    def start(self) -> GraphBuilder:
        self._again.set()
        self._thread = threading.Thread(target=self._run, name=f"graphs-{self.name}", daemon=True)
        self._thread.start()
        return self

    def state(self, graphs: StepGraphs | None) -> dict:
        """For /load: the installed batch ranges, where each package came from (local | store | built), steps run."""
        installed = list(graphs.graphs) if graphs is not None else []
        return {"installed": [[g.lo, g.hi] for g in sorted(installed, key=lambda g: g.lo)],
                "sources": dict(self.sources), "steps": graphs.steps if graphs is not None else 0,
                "idle": self._idle and (self._stop.is_set() or not self._again.is_set())}  # fmt: skip

    def again(self) -> None:
        """The kernels changed (a plan swap): take the graphs again."""
        self._again.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """End the thread after what it is doing; a build in progress is cut short: its process group (the builder
        process and every compiler it started) is killed at once (``compute.engine.graph_build``)."""
        self._stop.set()
        self._again.set()
        child = self._child
        if child is not None:
            graph_build.kill(child)
        if self._thread is None:
            return True
        self._thread.join(timeout)
        if child is not None:
            log.info("step graphs of %s: stopped mid-build (its builder process group killed)", self.name)
        return not self._thread.is_alive()

    def wait_idle(self, timeout: float) -> bool:
        """True once every graph of the current kernels has been taken (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._again.is_set() and self._idle:
                return True
            time.sleep(0.05)
        return False

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # this thread and the compiler it starts yield the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
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
            except graph_build.BuildStopped as e:
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
            path, source = self._package(gid, step, lo, hi, sp, mk)
            fn = load_package(path, step)
            self.sources.setdefault(gid, source)  # where it came from first: a re-take after a swap finds it here
            log.info("step graph %s (%s, batch %d-%d) %s, loaded in %.2f s", gid, self.name, lo, hi,
                     {"local": "from this machine", "store": "from the store", "built": "built"}[source],
                     time.perf_counter() - t0)  # fmt: skip
            self.install(Graph(lo, hi, sp["max_keys"], step, fn, gid))

    def _package(self, gid: str, step: GraphStep, lo: int, hi: int, sp: dict, mk: str) -> tuple[str, str]:
        """(path of the package's file, where it came from). One process of this machine builds a package at a time
        (a lock beside it); the others wait for it and then find it here."""
        local = os.path.join(self.dir, f"{gid}.pt2") if self.dir else None
        if local and os.path.exists(local):
            return local, "local"
        tmpdir = self.dir or tempfile.gettempdir()
        os.makedirs(tmpdir, exist_ok=True)
        with open(os.path.join(tmpdir, f".{gid}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
            if local and os.path.exists(local):
                return local, "local"
            return self._fetch_or_build(gid, step, lo, hi, sp, mk, local, tmpdir)

    def _fetch_or_build(self, gid: str, step: GraphStep, lo: int, hi: int, sp: dict, mk: str, local: str | None,
                        tmpdir: str) -> tuple[str, str]:  # fmt: skip
        got = self._from_store(gid)
        if got is not None:
            return self._save(got, local, gid), "store"
        t0 = time.perf_counter()
        log.info("step graph %s (%s, batch %d-%d): none in the store for this machine class, building it",
                 gid, self.name, lo, hi)  # fmt: skip
        _sweep(tmpdir)
        tmp = os.path.join(tmpdir, f".{gid}.{os.getpid()}.building.pt2")  # a killed build leaves it: swept
        try:
            graph_build.build(sp, lo, hi, tmp, self._stop, on_start=self._started)
            with open(tmp, "rb") as f:
                data = f.read()
        finally:
            self._child = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        log.info("step graph %s built in %.1f s (%.1f MiB)", gid, time.perf_counter() - t0, len(data) / 2**20)
        self._publish(gid, {"machine_key": mk, "model": self.model_key, "spec": sp}, data)
        return self._save(data, local, gid), "built"

    def _started(self, child) -> None:
        self._child = child
        if self._stop.is_set():  # a stop between the check and the start
            graph_build.kill(child)

    def _save(self, data: bytes, local: str | None, gid: str) -> str:
        path = local or os.path.join(tempfile.gettempdir(), f"pdserve-graph-{os.getpid()}-{gid}.pt2")
        tmp = os.path.join(os.path.dirname(path), f".{gid}.{os.getpid()}.building.pt2")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # never a half-written package under its name
        return path

    def _from_store(self, gid: str) -> bytes | None:
        if self.store is None or not hasattr(self.store, "graphs"):
            return None
        from paramstore.errors import NotFound, StoreError

        try:
            return self.store.graphs.get(gid)[1]
        except NotFound:
            return None
        except (StoreError, OSError) as e:  # corrupt, unsigned, tampered, unreachable: never loaded
            log.warning("step graph %s in the store ignored: %s", gid, e)
            return None

    def _publish(self, gid: str, meta: dict, data: bytes) -> None:
        if self.store is None or not hasattr(self.store, "graphs"):
            return
        from paramstore.errors import StoreError

        if not getattr(self.store.graphs, "can_publish", True):
            log.info("step graph %s kept on this machine: the store takes packages signed by the publisher key only",
                     gid)  # fmt: skip
            return
        try:
            self.store.graphs.publish(gid, meta, data)
            log.info("step graph %s published to the store", gid)
        except (StoreError, OSError) as e:
            log.warning("step graph %s not published to the store: %s", gid, e)
