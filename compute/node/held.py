"""One model held by a node runtime: its load thread, its serving parts, its bytes, and freeing it.

A ``Held`` is created ``loading`` by the host (``models.ModelHost``) and started: its load thread
(started from the event-loop thread, so never niced) injects the weights, then ``build``s the
serving parts — ``Engine`` (allocates the KV cache), ``EngineWorker`` (its own engine thread, fed
to a ``CapacityMeter``), ``NodeService``, the KV sender (prefill) or receiver (decode) over that
cache — and flips to ``ready``. ``free`` undoes all of it: engine thread stopped, transfer endpoint
closed (its registration of the cache gone), every reference to weights and cache dropped, and the
allocator asked to give the pages back (``malloc_trim``), so the process's RSS falls.

Memory is counted as the runtime holds it: the unique storages of the model's tensors (int8 weights
stay int8) plus the KV cache tensor. Before the load it is estimated from the manifest, and while it
loads the reader's shards in flight (``transient_bytes``, the prefetch the host chose) count too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import threading
import time

import msgspec
import torch

from compute.engine.cuda_graphs import CudaGraphs
from compute.engine.engine import Engine, StepOutput
from compute.engine.step_graphs import StepGraphs
from compute.modeling.config import ModelConfig
from compute.modeling.graph_step import GraphStep
from compute.modeling.kv_cache import KVCache, kv_dtype
from compute.modeling.loader import (
    DEFAULT_KERNEL_CACHE,
    RUNTIME,
    LoadProgress,
    WeightInjector,
    runtime_weights,
)
from compute.node import kv_ends
from compute.node import protocol as P
from compute.node.adapters import AdapterCache
from compute.node.capacity import CapacityMeter
from compute.node.config import NodeConfig
from compute.node.graph_builder import GraphBuilder
from compute.node.service import NodeService
from compute.node.worker import EngineWorker

log = logging.getLogger("pdserve.node")
LOAD_TIMEOUT_S = 600.0  # a load not done by then fails
_ELEM = {"int8": 1, "int4": 0.625, "bf16": 2, "fp32": 4}  # stored bytes per weight (int4: codes + scale/zero)
class Held:
    def __init__(self, name: str, weights: str, manifest, weights_estimate: int, kv_estimate: int,
                 transient: int = 0, prefetch: int = 2):  # fmt: skip
        self.name, self.weights, self.manifest = name, runtime_weights(manifest, weights), manifest
        self.weights_bytes, self.kv_bytes = weights_estimate, kv_estimate  # measured once ready
        self.transient_bytes, self.prefetch = transient, prefetch  # shards in flight while loading (reserved)
        self.state = "loading"  # loading | ready | draining | failed
        self.error: str | None = None
        self.created = time.time()
        self.last_used: float | None = None
        self.ready_s: float | None = None  # load request -> ready
        self.progress = LoadProgress(manifest.ref)
        self.injector: WeightInjector | None = None
        self.svc: NodeService | None = None
        self.meter: CapacityMeter | None = None
        self.graphs: GraphBuilder | None = None  # [node] step = graph: takes the compiled decode steps after ready
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the load thread's publish vs cancel

    @property
    def bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + (self.transient_bytes if self.state == "loading" else 0)

    def idle(self) -> bool:
        """Evictable: ready (or failed) with nothing in flight."""
        if self.state == "failed":
            return True
        if self.state != "ready" or self.svc is None:
            return False
        s = self.svc
        return not s.active and not s.held and (s.sender is None or s.sender.held() == 0)

    def start(self, cfg: NodeConfig, store, cache, loop, on_ready) -> None:
        t0 = time.perf_counter()

        def run():
            try:
                self._load(cfg, store, cache, loop, t0)
                if self.state == "ready":
                    on_ready(self)
            except Exception as e:  # noqa: BLE001 - reported in /load, the node lives on
                if not self._cancel.is_set():
                    self.error, self.state = f"{type(e).__name__}: {e}", "failed"
                    self.progress.error = self.error
                    log.error("model %s failed to load: %s", self.name, self.error)

        self._thread = threading.Thread(target=run, name=f"load-{self.name}", daemon=True)
        self._thread.start()

    def _load(self, cfg: NodeConfig, store, cache, loop, t0: float) -> None:
        from paramstore.reader import ReaderConfig

        inj = WeightInjector(store, self.name, self.weights, reader_config=ReaderConfig(prefetch=self.prefetch),
                             cache=cache, manifest=self.manifest, text=False, kernels=cfg.kernels,
                             kernel_cache=kernel_cache(cfg), device=cfg.device,
                             measure_share=cfg.measure_share, weight_copies_gb=cfg.weight_copies_gb)  # fmt: skip
        self.injector, self.progress = inj, inj.progress
        if self._cancel.is_set():
            return
        inj.start()
        if not inj.wait(LOAD_TIMEOUT_S):  # raises the load's own error
            inj.cancel()
            raise TimeoutError(f"weights not loaded in {LOAD_TIMEOUT_S:g} s")
        parts = build(cfg, self.name, inj, loop)
        with self._lock:
            if self._cancel.is_set():  # unloaded while building: undo
                _close(parts[0])
                return
            self.svc, self.meter = parts
            self.weights_bytes = tensor_bytes(inj.model)
            worker = self.svc.worker

            if cfg.compiled_step and cfg.device.startswith("cuda"):  # captured on the engine thread as they come
                worker.engine.runner.graphs = CudaGraphs(inj.model, worker.engine.runner.cache, cfg.max_num_seqs)
            elif cfg.compiled_step and inj.model.dtype == torch.float32:  # (GraphStep mirrors the int8/int4 runtime)
                self.graphs = start_graphs(cfg, self.name, inj, worker, store)

            def swapped() -> None:  # on the engine thread, between two steps
                self.weights_bytes = tensor_bytes(inj.model)
                worker.engine.clear_prefix_cache()  # cached KV was computed by the old kernels: other numbers
                if worker.engine.runner.graphs is not None:  # built for the old kernels: taken again for the new
                    worker.engine.runner.graphs.clear()
                if self.graphs is not None:
                    self.graphs.again()

            inj.attach(post=lambda fn: worker.post(lambda engine: fn()), served=lambda: worker.steps > 0,
                       busy=lambda: worker.engine is not None and worker.engine.has_unfinished(),
                       on_swap=swapped)  # fmt: skip
            self.kv_bytes = self.svc.worker.engine.runner.cache.kv.nbytes
            self.ready_s = time.perf_counter() - t0
            self.state = "ready"
        log.info("model %s ready in %.2f s: %.1f MiB weights + %.1f MiB KV", self.name, self.ready_s,
                 self.weights_bytes / 2**20, self.kv_bytes / 2**20)  # fmt: skip

    def cancel(self) -> None:
        with self._lock:
            self._cancel.set()
        if self.injector is not None:
            self.injector.cancel(timeout=0)  # a load after its shard, a kernel measurement after its slice

    def end_streams(self, reason: str) -> None:
        """Event loop: requests still open after the drain bound end now (``abort``) instead of hanging."""
        svc = self.svc
        for rid, a in list(svc.active.items()):
            q = svc.worker._streams.get(a.seq_id)
            if q is not None:
                q.put_nowait(StepOutput(a.seq_id, [], True, "abort", reason))
            svc.abort(rid)

    def _graph_state(self, svc) -> dict | None:
        builder, engine = self.graphs, svc.worker.engine if svc is not None else None
        if builder is None:
            return None
        return builder.state(engine.runner.graphs if engine is not None else None)

    def view(self, cfg: NodeConfig, node_draining: bool) -> P.ModelLoad:
        """This model's entry in /load's ``models`` (contract A)."""
        state = "draining" if node_draining and self.state == "ready" else self.state
        svc, meter = self.svc, self.meter
        engine = P.EngineLoad()
        if svc is not None:
            try:
                engine = svc.load()
            except AttributeError:  # freed by an unload meanwhile (its engine is gone)
                pass
        return P.ModelLoad(
            model=self.name, state=state, ref=self.manifest.ref, weights=self.weights, bytes=self.bytes,
            weights_bytes=self.weights_bytes, kv_bytes=self.kv_bytes, last_used=self.last_used,
            progress=self.progress.as_dict(), error=self.error, ready_s=self.ready_s,
            transient_bytes=self.transient_bytes if self.state == "loading" else 0, prefetch=self.prefetch,
            kernels=self.injector.kernel_state() if self.injector is not None else None,
            graphs=self._graph_state(svc), lora=svc.adapters.report() if svc is not None and svc.adapters else None,
            capacity=meter.report() if meter is not None else CapacityMeter(cfg.tpot_target_s, 1).report(),
            **msgspec.structs.asdict(engine),
        )  # fmt: skip


def build(cfg: NodeConfig, name: str, inj: WeightInjector, loop) -> tuple[NodeService, CapacityMeter]:
    """Engine, engine thread (started), service and KV endpoint of one loaded model."""
    from compute.kv_transfer import KVLayout

    model = inj.model
    eos = inj.eos_token_ids or model.config.eos_token_ids
    engine = Engine.for_model(model, num_blocks=cfg.kv_blocks, block_size=cfg.block_size,
                              max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                              eos_token_ids=eos, kv_cache_dtype=cfg.kv_dtype, prefix_cache=cfg.prefix_cache,
                              cache_key=f"{inj.manifest.ref}/{inj.weights}")  # fmt: skip
    meter = CapacityMeter(cfg.tpot_target_s, cfg.max_num_seqs)
    worker = EngineWorker(engine, loop, meter=meter, name=f"engine-{name}", model=name)
    svc = NodeService(dataclasses.replace(cfg, model=name, weights=inj.weights), worker, model.config.vocab_size)
    svc.tokenizer_json, svc.eos_token_ids = inj.tokenizer_json, tuple(eos or ())
    svc.adapters = AdapterCache(name, inj.manifest.ref, model.config, inj.store, inj.cache, cfg.max_loras,
                                int(cfg.max_lora_mb * 2**20), cfg.device, inj.weights,
                                cfg.kernels == "invariant")  # fmt: skip
    cache_t = engine.runner.cache
    layout = KVLayout(model.config.num_layers, cfg.block_size, model.config.num_kv_heads, model.config.head_dim,
                      cache_t.dtype)  # fmt: skip
    try:
        if cfg.role == "prefill":
            kv_ends.make_sender(svc, layout, cache_t.kv)
        elif cfg.role == "decode":
            kv_ends.make_receiver(svc, layout, cache_t.kv)
        if cfg.peer_kv and cfg.prefix_cache and cfg.device == "cpu":
            kv_ends.make_ends(svc, layout, cache_t.kv)  # export cached prefixes to peers, pull theirs
        worker.start()
    except BaseException:
        _close(svc)
        raise
    return svc, meter


def free(h: Held, wait_load_s: float = 30.0) -> None:
    """Stop and drop everything ``h`` holds (any thread but the engine's); memory back to the OS."""
    h.cancel()
    if h._thread is not None:
        h._thread.join(wait_load_s)
    with h._lock:
        svc, h.svc, h.meter, inj, h.injector = h.svc, None, None, h.injector, None
        graphs, h.graphs = h.graphs, None
        h.weights_bytes = h.kv_bytes = 0
    if graphs is not None:
        graphs.stop(timeout=2.0)  # then its compiler killed: the launcher SIGKILLs at 10 s
    if svc is not None:
        _close(svc)
    if inj is not None:
        inj.model = None
    del svc, inj
    gc.collect()
    trim()


def start_graphs(cfg: NodeConfig, name: str, inj: WeightInjector, worker: EngineWorker, store) -> GraphBuilder:
    """The compiled decode steps of a ready model (``compute/engine/step_graphs.py``): taken off the request path,
    installed on the engine thread only while the model still runs the kernels they were built for."""
    runner = worker.engine.runner
    runner.graphs = StepGraphs()

    def install(g) -> None:  # on the engine thread, between two steps
        if worker.engine is None or runner.graphs is None:
            return
        if GraphStep(runner.model, g.lo).kinds != g.step.kinds:  # a plan swap came first: take them again
            builder.again()
            return
        runner.graphs.install(g)

    builder = GraphBuilder(inj.model, runner.cache, cfg.max_num_seqs, store=store,
                           cache_dir=os.path.dirname(kernel_cache(cfg)), model_key=inj.weights,
                           plan_final=inj.plan_settled, install=lambda g: worker.post(lambda engine: install(g)),
                           name=name)  # fmt: skip
    return builder.start()


def _close(svc: NodeService) -> None:
    if not svc.worker.stop():
        log.warning("engine thread of %s did not stop in time", svc.config.model)
    for end in (svc.sender, svc.receiver):
        if end is not None:
            try:
                end.close()
            except Exception as e:  # noqa: BLE001 - freeing the rest matters more
                log.warning("closing the KV endpoint of %s: %s", svc.config.model, e)
    svc.sender = svc.receiver = None
    svc.worker.engine = None


def trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def kernel_cache(cfg: NodeConfig) -> str:
    """Where this node keeps the machine's kernel table: its cache dir, else the user's default."""
    return os.path.join(cfg.cache_dir, "int8.json") if cfg.cache_dir else DEFAULT_KERNEL_CACHE


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the unique storages behind the model's tensors (buffers and plain tensor attributes)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        for t in [*m._buffers.values(), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]:
            if t is not None and t.device.type != "meta":
                st = t.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def estimate_bytes(manifest, weights: str, cfg: NodeConfig) -> tuple[int, int]:
    """(weights, KV cache) bytes a load of ``manifest`` will hold, from the manifest alone."""
    w = runtime_weights(manifest, weights)
    stored = _ELEM.get(manifest.dtype, 4)
    held = stored if w == "int8" else _ELEM[w]
    wbytes = int(sum(s.size for s in manifest.weight_shards()) * held / stored)
    config = ModelConfig.from_hf(manifest.config)
    if w == "int8" and cfg.kernels != "fixed" and cfg.device == "cpu":  # the kernel table's bf16 copies
        from compute.kernels import int8
        from compute.kernels.budget import planned_copy_bytes
        from compute.modeling.model import linear_shapes

        table = int8.cached_table(torch.get_num_threads(), kernel_cache(cfg))  # as the loader will read it
        budget = None if cfg.weight_copies_gb < 0 else int(cfg.weight_copies_gb * 2**30)
        wbytes += planned_copy_bytes(linear_shapes(config), table, cfg.kernels, budget)
    dtype, int8 = RUNTIME[w]
    kv = KVCache.bytes_per_block(config, cfg.block_size, kv_dtype(cfg.kv_dtype, dtype, int8)) * cfg.kv_blocks
    return wbytes, kv


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
