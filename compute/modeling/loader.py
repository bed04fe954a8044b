"""Lazy injection: a node starts with no weights and fills its model shard by shard from paramstore.

Lifecycle of a node's weights:
 1. open the manifest (pinned version or latest) and read the bundle shard (tokenizer, template);
 2. build the ``Transformer`` on the meta device from the manifest's HF config: no memory yet;
 3. a background thread iterates the weight shards in load order (embed, blocks, head) through
    the store's reader, which keeps ``prefetch`` shards in flight (fetch, verify, decode overlap
    with injection); each shard's tensors are ``torch.frombuffer`` views of its decoded buffer and
    are assigned to the model as they are (INT8 stays INT8: no second copy);
 4. ``progress`` is observable at any time (layers, shards, bytes, seconds); ``ready`` flips once
    every tensor is present; the time to ready is recorded as a metric;
 5. the int8 kernels: the plan the store or this machine's cache holds, else the safe rule — never a
    measurement before ready (``measure="background"``, ``compute.kernels.plans``): a measurement, if
    one is needed, starts after ready and its plan is swapped in through the node's engine thread
    (``attach``); ``measure="blocking"`` measures before ready (benchmarks, tools).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass

import torch
from prometheus_client import Gauge, Histogram

from compute.kernels.int8 import DEFAULT_CACHE as DEFAULT_KERNEL_CACHE
from compute.kernels.int8 import MODES as KERNEL_MODES
from compute.kernels.int8 import plan_for
from compute.kernels.plans import PLANS, BackgroundMeasure, lookup, rule_table
from compute.modeling.config import ModelConfig
from compute.modeling.model import Transformer
from compute.modeling.tokenizer import TextBundle, _token_name
from paramstore.quant import dequantize_int8
from paramstore.quant4 import ZERO_SUFFIX, dequantize_int4

log = logging.getLogger("pdserve.node")
TIME_TO_READY = Histogram("pdserve_node_time_to_ready_seconds", "Node start to all weights injected",
                          buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 180))  # fmt: skip
LAYERS_LOADED = Gauge("pdserve_node_layers_loaded", "Decoder layers with every weight injected")

# runtime weights -> (activation dtype, keep int8); int8 keeps an fp32 residual stream (see compute.kernels.linear)
RUNTIME = {"int8": (torch.float32, True), "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False)}


@dataclass(slots=True)
class LoadProgress:
    model: str = ""
    layers_loaded: int = 0
    layers_total: int = 0
    shards_loaded: int = 0
    shards_total: int = 0
    bytes_loaded: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    ready: bool = False
    error: str | None = None
    released_bytes: int = 0  # shard-buffer bytes handed back after their tensors were copied

    def as_dict(self) -> dict:
        return asdict(self)


def bundle_eos_ids(files: dict[str, bytes]) -> tuple[int, ...]:
    """The EOS ids ``TextBundle.from_files`` would find, without building the tokenizer."""
    tcfg = json.loads(files.get("tokenizer_config.json", b"{}") or b"{}")
    gcfg = json.loads(files.get("generation_config.json", b"{}") or b"{}")
    eos = gcfg.get("eos_token_id", tcfg.get("eos_token_id"))
    name = _token_name(tcfg.get("eos_token"))
    if eos is None and name is not None and "tokenizer.json" in files:
        added = json.loads(files["tokenizer.json"]).get("added_tokens") or []
        eos = next((t["id"] for t in added if t.get("content") == name), None)
        if eos is None:  # a plain vocabulary token: ask the tokenizer itself
            return tuple(TextBundle.from_files(files).eos_token_ids)
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(int(e) for e in ids)


def transient_bytes(manifest, prefetch: int) -> int:
    """Decoded shard buffers a load of ``manifest`` holds at once beyond its final tensors: the reader's
    ``max(1, prefetch)`` shards in flight (the one being injected is one of them)."""
    sizes = sorted((s.size for s in manifest.weight_shards()), reverse=True)
    return sum(sizes[: max(1, prefetch)])


def release_copied(buffer, tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> int:
    """Hand back to the OS the whole pages of a shard buffer that no tensor of ``model`` views any more
    (those it copied: fused parts, converted dtypes); -> bytes released. Only an anonymous mmap (the
    reader's buffers from 1 MiB on) is released; anything else is left as is."""
    import mmap

    base_obj = getattr(buffer, "obj", None)
    if not isinstance(base_obj, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or not tensors:
        return 0
    from paramstore.buffers import address

    base = address(base_obj)
    size = len(base_obj)
    kept: list[tuple[int, int]] = []  # byte ranges of the buffer some tensor of the model still views
    for m in model.modules():
        for t in [*m._buffers.values(), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]:
            if t is None or t.device.type == "meta" or not t.numel():
                continue
            st = t.untyped_storage()
            lo, hi = st.data_ptr() - base, st.data_ptr() - base + st.nbytes()
            if hi > 0 and lo < size:
                kept.append((max(0, lo), min(size, hi)))
    page = mmap.PAGESIZE
    kept.sort()
    released, cursor = 0, 0
    for start, end in [*kept, (size, size)]:
        lo, hi = -(-cursor // page) * page, (start // page) * page  # whole pages strictly between kept ranges
        if hi > lo:
            base_obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            released += hi - lo
        cursor = max(cursor, end)
    return released


def runtime_weights(manifest, weights: str) -> str:
    """The runtime weights a load of ``manifest`` asked for ``weights`` gets (a float import keeps no int8).
    ``int8`` means the store's quantized weights as stored: an ``int4`` import keeps its int4 linears too."""
    return "bf16" if weights == "int8" and manifest.dtype not in ("int8", "int4") else weights


class WeightInjector:
    """Owns one model's lazy load from the store (steps 1-4 above)."""

    def __init__(self, store, ref: str, weights: str = "int8", reader_config=None, cache=None, manifest=None,
                 text: bool = True, kernels: str = "measured", kernel_cache: str | None = DEFAULT_KERNEL_CACHE,
                 device: str = "cpu", measure: str = "background", measure_share: float = 0.25,
                 weight_copies_gb: float = -1):  # fmt: skip
        """``text=False`` (a node: the gateway tokenizes) skips building the tokenizer (~0.3 s for SmolLM2's);
        ``eos_token_ids`` is read from the bundle either way. ``kernels``: ``measured`` (int8 weights run the
        kernels this machine's table chose, ``compute.kernels.int8``; the table cached at ``kernel_cache``) or
        ``fixed`` (int8mm up to M = 64, dequant beyond). ``device``: where the weights go (the
        kernel table is the host's: on another device int8 weights run dequantized). ``weight_copies_gb``: the
        bf16 weight copies the plan may keep, GiB (-1: no limit; 0: none; ``compute.kernels.budget``)."""
        if weights not in RUNTIME:
            raise ValueError(f"invalid runtime weights {weights!r}: int8, bf16 or fp32")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"invalid kernels {kernels!r}: one of {', '.join(KERNEL_MODES)}")
        if measure not in ("background", "blocking"):
            raise ValueError(f"invalid measure {measure!r}: background or blocking")
        self.kernels, self.kernel_cache, self.kernel_table = kernels, kernel_cache, None
        self.copy_budget = None if weight_copies_gb < 0 else int(weight_copies_gb * 2**30)  # bytes; None: no limit
        self.measure, self.measure_share, self.kernel_source = measure, measure_share, ""
        self.planner: BackgroundMeasure | None = None  # measures a missing plan after ready
        self._engine_hooks: dict | None = None  # attach(): how a measured plan reaches a serving model
        self._plan_lock = threading.Lock()
        self._pending: tuple[dict, str] | None = None  # a planner result that came before ``attach``
        self._swapping = 0  # swaps posted to the engine thread and not run yet (``plan_settled``)
        self.t0 = time.perf_counter()
        self.store, self.reader_config, self.cache = store, reader_config, cache
        self.manifest = manifest if manifest is not None else store.manifest(ref)
        weights = runtime_weights(self.manifest, weights)
        self.dtype, self.keep_int8 = RUNTIME[weights]
        self.weights = weights
        self.config = ModelConfig.from_hf(self.manifest.config)
        with store.reader(self.manifest, reader_config, cache) as r:
            files = r.bundle()
        # a model imported without a tokenizer still serves token ids (the gateway needs the bundle)
        self.bundle = TextBundle.from_files(files) if text and "tokenizer.json" in files else None
        self.eos_token_ids = tuple(self.bundle.eos_token_ids) if self.bundle else bundle_eos_ids(files)
        self.tokenizer_json = files.get("tokenizer.json")  # structured output builds its matchers from it
        self.model = Transformer.build(self.config, self.dtype, device=device)
        shards = self.manifest.weight_shards()
        self.progress = LoadProgress(self.manifest.ref, 0, self.config.num_layers, 0, len(shards), 0,
                                     sum(s.size for s in shards))  # fmt: skip
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "WeightInjector":
        self._thread = threading.Thread(target=self._run, name="weight-injector", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """True once ready; raises the load error if the load failed."""
        self._done.wait(timeout)
        if self.progress.error:
            raise RuntimeError(f"weight load failed: {self.progress.error}")
        return self.progress.ready

    @property
    def ready(self) -> bool:
        return self.progress.ready

    def cancel(self, timeout: float = 10.0) -> bool:
        """Stop a load in progress after its current shard (and a kernel measurement); True once the load
        thread has ended."""
        self._cancel.set()
        if self.planner is not None:
            self.planner.stop(min(timeout, 5.0))  # timeout 0 (a node's event loop): signalled, not awaited
        return self._done.wait(timeout) if self._thread is not None else True

    def _run(self) -> None:
        p = self.progress
        try:
            with self.store.reader(self.manifest, self.reader_config, self.cache) as r:
                for read in r.iter_shards():
                    if self._cancel.is_set():
                        raise RuntimeError("load cancelled (unloaded)")
                    tensors, _ = read.tensors()
                    self.model.load_weights(self._convert(tensors))
                    p.released_bytes += release_copied(read.buffer, tensors, self.model)
                    p.shards_loaded += 1
                    p.bytes_loaded += read.shard.size
                    del tensors, read  # this shard's buffer goes (or keeps only its viewed pages) now
                    p.layers_loaded = self.model.layers_loaded()
                    p.seconds = time.perf_counter() - self.t0
                    LAYERS_LOADED.set(p.layers_loaded)
            if not self.model.ready:
                raise RuntimeError(f"weights missing after every shard: {self.model.missing_weights()[:5]}")
            injected_s = time.perf_counter() - self.t0
            self._plan_kernels()
            p.ready = True
            p.seconds = time.perf_counter() - self.t0
            TIME_TO_READY.observe(p.seconds)
            log.info("model %s ready in %.2f s (%d shards, %.1f MiB, %s weights; injected at %.2f s, then kernels: %s)",
                     p.model, p.seconds, p.shards_loaded, p.bytes_loaded / 2**20, self.weights, injected_s,
                     self.kernel_source or "none")  # fmt: skip
            if self.planner is not None:
                self.planner.start()
        except Exception as e:  # noqa: BLE001 - reported through progress and /ready
            p.error = f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", p.model, p.error)
        finally:
            self._done.set()

    # --- kernels (step 5) ------------------------------------------------------------------
    def _plan_kernels(self) -> None:
        """The plan to serve with now: store, this machine's cache, or the rule (measured later, off the path)."""
        if self.kernels == "fixed" or self.model.device.type != "cpu" or not self.model.int8_shapes():
            return
        shapes, threads = self.model.int8_shapes(), torch.get_num_threads()
        if self.measure == "blocking":
            try:  # once per machine (cached by CPU, torch version and threads); a warm table costs ~1 ms
                table = plan_for(shapes, threads, self.kernel_cache)
            except OSError as e:  # an unwritable cache costs a measurement per load, never the load
                log.warning("kernel table cache %s unusable (%s): measuring without it", self.kernel_cache, e)
                table = plan_for(shapes, threads, None)
            source = "local" if table.pop("cached") else "measured"
        else:
            table, source = lookup(shapes, threads, self.kernel_cache, self.store)
            if table is None:
                table, source = rule_table(shapes, threads), "rule"
            if source != "store":  # measure what is missing, or publish the machine's plan to the store
                self.planner = BackgroundMeasure(shapes, threads, self.kernel_cache, self.store, self._measured,
                                                 busy=self._busy, share=self.measure_share, name=self.manifest.ref)  # fmt: skip
        self.model.use_kernels(table, self.kernels, self.copy_budget)
        self.kernel_table, self.kernel_source = table, source
        PLANS.labels(source).inc()

    def attach(self, post, served, busy, on_swap=None) -> None:
        """A serving engine around the model: ``post(fn)`` runs fn on its thread between two steps, ``served()``
        says whether it has run a request, ``busy()`` whether it has work now; ``on_swap()`` after a swap."""
        with self._plan_lock:
            self._engine_hooks = {"post": post, "served": served, "busy": busy, "on_swap": on_swap}
            pending, self._pending = self._pending, None
        if pending is not None:  # the planner finished before the engine existed
            self._measured(*pending)

    def plan_settled(self, timeout: float) -> bool:
        """True once the kernel plan will not change: no measurement running and its swap, if any, applied on
        the engine thread (what the step graphs wait for: they compile the kernels the model runs)."""
        pl = self.planner
        return (pl is None or pl.wait(timeout)) and self._swapping == 0 and self._pending is None

    def kernel_state(self) -> dict:
        pl = self.planner
        return {"mode": self.kernels, "source": self.kernel_source,
                "measure": pl.state if pl is not None else ("off" if self.kernels == "fixed" else "none")}  # fmt: skip

    def _busy(self) -> bool:
        hooks = self._engine_hooks
        return bool(hooks and hooks["busy"]())

    def _measured(self, table: dict, source: str) -> None:
        """The planner's result (its thread): swapped in between two steps of the attached engine; under
        ``invariant`` only before its first request. Without an engine (in-process use: tools, tests) the model
        keeps the plan it started with (its numbers do not change under its caller); the next start takes it."""
        if source == "local" and self.kernel_source == "local":
            return  # the plan served already; it was only published
        model, mode = self.model, self.kernels
        with self._plan_lock:
            hooks = self._engine_hooks
            if hooks is None:
                self._pending = (table, source)  # for an engine attached later (a node builds it after ready)
        if model is None or hooks is None:
            return

        def swap() -> None:
            try:
                _swap()
            finally:
                with self._plan_lock:
                    self._swapping -= 1

        def _swap() -> None:
            if mode == "invariant" and hooks["served"]():
                log.info("kernel plan (%s) kept for the next start: under kernels = invariant a node that has "
                         "served keeps its plan", source)  # fmt: skip
                return
            model.use_kernels(table, mode, self.copy_budget)
            self.kernel_table, self.kernel_source = table, source
            PLANS.labels(source).inc()
            log.info("kernel plan swapped in: %s (%d shapes)", source, len(table["shapes"]))
            if hooks["on_swap"] is not None:
                hooks["on_swap"]()

        if mode != "invariant":
            model.prepare_kernels(table, mode, self.copy_budget)  # bf16 copies made here, not on the engine thread
        with self._plan_lock:
            self._swapping += 1
        hooks["post"](swap)

    def _convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored tensors -> runtime tensors: keep INT8 / INT4 as is, or dequantize for a float runtime. INT4 runs
        on the CPU's int4 kernel only: on another device its weights are dequantized to the activation dtype
        (``compute.kernels.int4``)."""
        int4_float = not self.keep_int8 or self.model.device.type != "cpu"
        if self.keep_int8 and not (int4_float and any(n.endswith(ZERO_SUFFIX) for n in tensors)):
            return tensors
        out = {}
        for name, t in tensors.items():
            if name.endswith(("_scale", ZERO_SUFFIX)):
                continue
            scale, zero = tensors.get(name + "_scale"), tensors.get(name + ZERO_SUFFIX)
            if zero is not None:  # int4 (dequantized: a float runtime, or a device without the kernel)
                out[name] = dequantize_int4(t, scale, zero, self.dtype)
            elif scale is not None and not self.keep_int8:
                out[name] = dequantize_int8(t, scale, self.dtype)
            else:
                out[name] = t
                if scale is not None:
                    out[name + "_scale"] = scale
        return out
