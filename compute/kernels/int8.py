"""INT8-weight linear kernels, chosen by measurement on the machine that runs them.

Machines of one kind do not share a CPU (AVX2 only; AVX-512 with bf16/VNNI; AMX): the same
kernel wins on one and loses 10x on another (FIELD-NOTES; the table in ``compute/kernels/linear.py``).
So nothing here assumes a CPU:

1. ``plan_for(shapes, threads, cache_path)``: the machine's key (CPU model name, its ISA flags, torch's dispatch level,
   torch version, threads) names a JSON file; if it holds a table for every shape, it is used;
2. otherwise ``measure`` times every usable candidate on each weight shape ``[N, K]`` of the
   model at one M per bucket (``BUCKETS``), min of ``repeats`` interleaved runs, and checks each
   candidate's error against an fp32 reference on activations with outlier channels (as real
   LLM activations have); the fastest within ``ERROR_GATE`` wins each bucket;
3. each candidate is also probed for *row invariance*: every row of its output bitwise the same at
   every M in ``INVARIANCE_M`` as computed alone. Measured on the AMX Xeon: only int8mm is (each
   output tile's K loop is the same whatever M); oneDNN's bf16 GEMM changes its blocking at M = 33-64
   and others, MKL's fp32 GEMM below M ~ 16-25. ``invariant`` names the row-invariant kernel within
   the gate with the least total time over the probe Ms among ``INVARIANT_BY_CONSTRUCTION`` (None if
   there is none);
4. the table is written (atomically) and each int8 linear gets its plan (``plan_of``):
   ``measured`` (the default) the fastest per bucket; ``invariant`` the ``invariant`` kernel at
   every M, so a request's numbers do not depend on its batch (greedy output alone == in any batch:
   tests/compute/modeling/test_realmodel.py), at a price where another kernel is faster (prefill, batched
   decode); a ``bf16`` plan makes one bf16 copy of that weight at that moment (memory: +2 bytes
   per parameter of that linear, counted).

Candidates (``KERNELS``), all taking x in any float dtype and returning y in ``out`` dtype:

- ``int8mm``: ``torch.ops.aten._weight_int8pack_mm`` on x cast to bf16 (weight-only int8; cost
  linear in M on x86); needs K % 16 == 0 and 64-byte aligned inputs (``compute/kernels/linear.py``);
- ``dequant``: the weight dequantized into a reused fp32 scratch, fp32 ``F.linear``;
- ``bf16``: a bf16 copy of the dequantized weight, bf16 ``F.linear`` (oneDNN: native on
  avx512_bf16 / AMX CPUs, emulated and slow on AVX2);
- ``w8a8``: x quantized per row to int8, ``torch._int_mm`` (oneDNN s8s8s32: VNNI / AMX-int8;
  without VNNI, i.e. AVX2 dispatch, its u8s8 pairs saturate at int16 and the product is not exact:
  6-9% error measured, out by the gate), rescaled by row and column scales. Batch-invariant by construction (each row its own scale),
  but on SmolLM2 per-row activation int8 costs +4% perplexity (FIELD-NOTES figures re-measured:
  CC0 1.0417, Zen 1.1215, Apache 1.0396 vs fp32): the error gate keeps it out unless a
  machine's activations allow it; it is measured and printed so the table says why;
- ``w8a16``: x split per row into two int8 levels (``w8a16``), one ``torch._int_mm`` over the 2M rows: no float copy
  of the weight, batch-invariant by construction, 0.01-0.02% error (bf16: 0.3%); slower than the bf16 copy at
  M = 32 (1.1-1.6x: the quantization's ~15 small ops), faster than int8mm from M ~ 32 on
  (benchmarks/weight_copies.py). The no-copy kernel a ``weight_copies_gb`` budget falls back to
  (``compute.kernels.budget``);
- ``otf``: the int8 weight converted to bf16 per call into a reused 16 MiB buffer (weights up to 8M parameters),
  bf16 ``F.linear``, the scale applied to the output: no resident copy; 1.1-1.4x the copy at M = 32, ~1.0-1.1x
  at M = 512 (the conversion amortised: prefill);
- ``native``: pdserve's own C++ kernel (``compute.kernels.native``, built at install): each weight byte read once
  and widened to fp32 in registers, fp32 sums (error ~1e-7: no activation rounding at all), AVX-512 / AVX2 / scalar
  bodies by the CPU; row-invariant by construction (every output's K loop is the same at any M). At M = 1 it runs at
  the memory bandwidth where ATen's int8mm does not (AVX2: int8mm converts per 4x4 tile); it is the rule's kernel
  up to M = ``RULE_NATIVE_MAX_M`` wherever it is built.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from compute.kernels import native
from compute.kernels.artefacts import machine_lock
from compute.kernels.machine import ISA_FLAGS, cpu, machine, machine_key  # noqa: F401 - re-exported (plans, tests)
from compute.kernels.nocopy import _OTF_MAX, SCRATCH_BYTES, W8A16_LO, otf_weight, scratch, w8a16  # noqa: F401 - some re-exported
from paramstore.buffers import (
    ALIGN,  # the int8 kernel needs aligned inputs (see ``aligned``)
)
from paramstore.quant import dequantize_int8 as dequantize  # the store's int8 scheme

BUCKETS = (1, 8, 64, None)  # upper bounds of M per bucket: 1 | 2-8 | 9-64 | 65+
PROBE_M = (1, 8, 32, 256)  # the M each bucket is timed at
KERNELS = ("int8mm", "dequant", "bf16", "w8a8", "w8a16", "otf", "native")
ERROR_GATE = 0.01  # relative RMS error vs fp32 on outlier activations: ~3x bf16 rounding (int8mm, bf16: 0.3%; w8a8: 1.8-4.4%)
SHAPE_BUDGET_S = 4.0  # kernel time spent timing one shape's candidates, at most: then the best so far stands
INT8MM_K_MULTIPLE = 16  # the int8 kernel only for K % 16 == 0 (AVX-512 needs it, AVX2 K % 8: compute/kernels/linear.py)
TABLE_VERSION = 10  # 8: w8a16; 9: otf; invariant only from INVARIANT_BY_CONSTRUCTION; 10: native
# measured: the fastest per M bucket; invariant: one batch-invariant kernel per shape;
# fixed: int8mm up to M = 64, dequant beyond, on every CPU (the rule before this)
MODES = ("measured", "invariant", "fixed")
# every row at these M as in the largest, whose rows are as alone: each tile edge of the kernels probed (only those
# row-invariant by construction are: 4, 8, 16 rows and their neighbours) and a few prefill sizes
INVARIANCE_M = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 200, 256)
INVARIANCE_ROWS = 8  # rows of the largest M compared with each computed alone
# the kernels ``invariant`` may name: row-invariant by construction (int8mm: each output tile's K loop is the same at
# any M; w8a16: integer-exact products, a scale per row), and then by the probe (a CPU can break the construction:
# _int_mm without VNNI). oneDNN's bf16 GEMM passed the probe on the Zen 4 box yet SmolLM2's greedy output under it
# differed alone vs in a batch of 16 (tests/compute/modeling/test_realmodel.py): a probe alone is not trusted
INVARIANT_BY_CONSTRUCTION = ("int8mm", "w8a16", "native")
# one per machine (per user): $XDG_CACHE_HOME/pdserve/kernels.json, else ~/.cache/pdserve/kernels.json
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                             "pdserve", "kernels.json")  # fmt: skip

_SCRATCH_MAX = SCRATCH_BYTES // 4  # fp32 elements (16 MiB): the largest weight dequantized into the scratch


def dequantize_scratch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dequantize`` to fp32 into a reused per-thread buffer (no page faults of a fresh allocation).

    Equal to ``dequantize(q, scale)``; valid until the next call in this thread.
    """
    n = q.numel()
    if n > _SCRATCH_MAX or q.device.type != "cpu":  # the scratch serves the host's page-fault cost only
        return dequantize(q, scale)
    return torch.mul(q, scale[:, None], out=scratch(torch.float32, q.shape))


def is_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts at a multiple of ``ALIGN`` (an empty tensor has no data: it is)."""
    return t.numel() == 0 or t.data_ptr() % ALIGN == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its data is ``ALIGN``-byte aligned, else an aligned copy.

    ``_weight_int8pack_mm``'s AVX-512 kernel segfaults on an int8 weight at an address
    = 8 or 40 (mod 64), or a bf16 input not 32-byte aligned, once M > 1 (table in ``compute/kernels/linear.py``).
    Store shards place data at 64-byte offsets (``paramstore.shards.pack``), but a view of an
    older blob, of a tensor after one whose size is not a multiple of 64, or of a buffer with
    weaker alignment is copied here, once, at load, in its runtime form (``_WeightSlot.load``
    after ``prepare``: a tensor ``prepare`` converted, or a ``LinearPart``'s copied into the
    fused buffer, is fresh memory already); ``run`` passes an int8mm input through it per call
    (free when aligned, the usual case). PyTorch's CPU allocator returns 64-byte aligned memory.
    """
    if is_aligned(t):
        return t
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    out.copy_(t)
    return out


def bucket(m: int) -> int:
    """Index of the bucket of M rows."""
    for i, hi in enumerate(BUCKETS):
        if hi is None or m <= hi:
            return i
    raise AssertionError("unreachable")


def usable(name: str, n: int, k: int) -> bool:
    if name == "native":
        return native.available()
    if name == "otf":
        return n * k <= _OTF_MAX
    return name != "int8mm" or k % INT8MM_K_MULTIPLE == 0


def run(name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_bf16: torch.Tensor,
        w_bf16: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x: [M, K] float @ (q: [N, K] int8 * scale: [N])^T -> [M, N] (bf16 for int8mm/bf16, else fp32)."""
    if name == "int8mm":
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        return torch.ops.aten._weight_int8pack_mm(aligned(xb.contiguous()), q, scale_bf16)
    if name == "bf16":
        return F.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), w_bf16)
    if name == "dequant":
        return F.linear(x.to(torch.float32), dequantize_scratch(q, scale))
    if name == "w8a8":
        x32 = x.to(torch.float32)
        a = x32.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0  # [M, 1]
        xq = torch.round(x32 / a).to(torch.int8)
        return torch._int_mm(xq, q.t()) * a * scale  # int32 [M, N] -> fp32
    if name == "w8a16":
        return w8a16(x, q, scale)
    if name == "otf":
        return F.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), otf_weight(q)).mul_(scale_bf16)
    if name == "native":
        return native.int8_linear(x, q, scale)
    raise ValueError(f"unknown kernel {name!r}: one of {', '.join(KERNELS)}")


BF16_BLOCK_ELEMS = 1 << 17  # 512 KiB of fp32 per block: within L2 on the CPUs we met


def bf16_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dequantized weight in bf16 (the ``bf16`` kernel's copy), bitwise ``(q.float() * scale).bfloat16()``.
    Converted in row blocks whose fp32 intermediate stays in cache: ~4x faster than the whole-tensor
    expression (a 49152x576 head: 29 vs 115 ms, 1 thread), which is most of a model load's time."""
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    rows = max(1, BF16_BLOCK_ELEMS // max(1, q.shape[1]))
    for i in range(0, q.shape[0], rows):
        out[i : i + rows] = q[i : i + rows].to(torch.float32) * scale[i : i + rows, None]
    return out


def plan_of(entry: dict, mode: str) -> tuple[str, ...]:
    """The kernel per M bucket a shape's table ``entry`` gives under ``mode`` (measured | invariant)."""
    if mode == "invariant" and entry.get("invariant"):
        return (entry["invariant"],) * len(BUCKETS)
    return tuple(entry["choice"])  # measured, or no row-invariant kernel passed the gate on this machine


def row_invariant(name: str, q: torch.Tensor, scale: torch.Tensor, sb: torch.Tensor, wb: torch.Tensor | None,
                  gen: torch.Generator) -> bool:  # fmt: skip
    """Every row of ``name``'s output is bitwise the same at every M in ``INVARIANCE_M`` as in the largest
    batch, and there as computed alone (first ``INVARIANCE_ROWS`` rows): neither the batch size nor where
    a row sits in it may matter (a GEMM may change its blocking with M, or run tail rows otherwise)."""
    return _drain(_row_invariant_steps(name, q, scale, sb, wb, gen))


def _row_invariant_steps(name, q, scale, sb, wb, gen):
    """``row_invariant`` one M at a time (a generator: yields between probes, returns the answer)."""
    x = torch.randn(max(INVARIANCE_M), q.shape[1], generator=gen)
    big = run(name, x, q, scale, sb, wb)
    yield
    if not all(torch.equal(run(name, x[i : i + 1], q, scale, sb, wb)[0], big[i]) for i in range(INVARIANCE_ROWS)):
        return False
    for m in INVARIANCE_M:
        yield
        if not torch.equal(run(name, x[:m], q, scale, sb, wb), big[:m]):
            return False
    return True


def _drain(steps):
    """Run a generator of work slices to its end; -> its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def cached_table(threads: int, cache_path: str | None = DEFAULT_CACHE) -> dict | None:
    """This machine's cached table for ``threads`` (None if none is cached yet); never measures."""
    return _read(cache_path).get(machine_key(threads))


def _outlier_input(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[M, K] fp32 activations: unit normal with a few channels 30x larger (as LLM residuals have)."""
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[: max(1, k // 100)]] *= 30.0
    return x


def measure(shapes: Iterable[tuple[int, int]], threads: int, repeats: int = 7,
            kernels: Iterable[str] = KERNELS, budget_s: float = SHAPE_BUDGET_S) -> dict:  # fmt: skip
    """Time and check every usable kernel on each [N, K] at ``PROBE_M``; -> the table (see the module doc)."""
    return _drain(measure_steps(shapes, threads, repeats, kernels, budget_s=budget_s))


def candidates(kernels: Iterable[str] = KERNELS, flags: str | None = None) -> list[str]:
    """The kernels worth measuring on this CPU: a bf16 GEMM (``bf16``, ``otf``) only where the CPU has bf16
    arithmetic (avx512_bf16, AMX), an int8 GEMM (``w8a8``, ``w8a16``) only where it has VNNI or AMX-int8 (elsewhere
    oneDNN emulates them: 3-10x behind, or inexact, on the AVX2 box; FIELD-NOTES)."""
    have = cpu()[1] if flags is None else set(flags.split())
    bf16 = bool(have & {"avx512_bf16", "amx_bf16"})
    vnni = bool(have & {"avx512_vnni", "avx_vnni", "amx_int8"})
    return [c for c in kernels if (c not in ("bf16", "otf") or bf16) and (c not in ("w8a8", "w8a16") or vnni)]


def measure_steps(shapes: Iterable[tuple[int, int]], threads: int, repeats: int = 7, kernels: Iterable[str] = KERNELS,
                  on_shape=None, budget_s: float = SHAPE_BUDGET_S):  # fmt: skip
    """``measure`` in slices: a generator that yields between small pieces of work (one candidate's timing
    round at one M, one invariance probe: milliseconds to ~0.1 s) so that a caller can pace it off the request
    path (``compute.kernels.plans``), and returns the table. ``on_shape(table)`` gets the table so far after each
    shape (progress that survives the process). Bounded: only ``candidates`` this CPU can win with are timed,
    a candidate 4x behind is dropped after one run, and a shape's timing stops repeating once its runs have taken
    ``budget_s`` (each candidate still timed at least twice at every M)."""
    kernels = candidates(kernels)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict] = {}

    def table() -> dict:
        return {"version": TABLE_VERSION, "key": machine_key(threads), "probe_m": list(PROBE_M),
                "buckets": [b or "inf" for b in BUCKETS], "error_gate": ERROR_GATE, "shapes": dict(out)}  # fmt: skip

    for n, k in sorted(set(shapes)):
        w = torch.randn(n, k, generator=gen) * 0.05
        scale = w.abs().amax(1).clamp_min(1e-8) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        sb, wb, wref = scale.to(torch.bfloat16), bf16_weight(q, scale), q.to(torch.float32) * scale[:, None]
        names = [c for c in kernels if usable(c, n, k)]
        err, us = {}, {}
        xe = _outlier_input(16, k, gen)
        ref = F.linear(xe.double(), wref.double())
        for c in names:
            try:
                y = run(c, xe, q, scale, sb, wb).double()
                err[c] = float((y - ref).norm() / ref.norm())
            except RuntimeError as e:  # a kernel this build or CPU lacks: out of the table, with why
                err[c] = f"{type(e).__name__}: {str(e)[:80]}"
        ok = [c for c in names if isinstance(err[c], float) and err[c] <= ERROR_GATE]
        yield
        spent = 0.0  # seconds of kernel runs for this shape (the budget)
        for m in PROBE_M:
            x = torch.randn(m, k, generator=gen)
            t = {}
            for c in ok:  # warm-up, timed: a candidate 4x behind the best here is not timed again
                t0 = time.perf_counter()
                run(c, x, q, scale, sb, wb)
                t1 = time.perf_counter()
                run(c, x, q, scale, sb, wb)
                t[c] = time.perf_counter() - t1
                spent += time.perf_counter() - t0
            close = [c for c in ok if t[c] <= 4 * min(t.values())]
            for _ in range(repeats):  # interleaved: a noisy neighbour hits every candidate alike
                if spent > budget_s:
                    break
                yield
                for c in close:
                    t0 = time.perf_counter()
                    run(c, x, q, scale, sb, wb)
                    dt = time.perf_counter() - t0
                    t[c], spent = min(t[c], dt), spent + dt
            us[str(m)] = {c: round(v * 1e6, 1) for c, v in t.items()}
        choice = [min(us[str(m)], key=us[str(m)].get) if ok else "dequant" for m in PROBE_M]
        inv = {}
        for c in ok:  # only a kernel invariant by construction may be named invariant: the others are not probed
            if c in INVARIANT_BY_CONSTRUCTION:
                inv[c] = yield from _row_invariant_steps(c, q, scale, sb, wb, gen)
        total = {c: sum(us[str(m)].get(c, float("inf")) for m in PROBE_M) for c in ok
                 if inv.get(c)}
        out[f"{n}x{k}"] = {"choice": choice, "us": us, "error": err, "row_invariant": inv,
                           "invariant": min(total, key=total.get) if total else None}  # fmt: skip
        if on_shape is not None:
            on_shape(table())
    return table()


def plan_for(shapes: Iterable[tuple[int, int]], threads: int, cache_path: str | None = DEFAULT_CACHE) -> dict:
    """The kernel table for ``shapes`` on this machine: read from ``cache_path`` if it has them, else measured
    here and now (blocking: benchmarks and tools; a node measures off its request path, ``compute.kernels.plans``).

    Processes of one machine that find no table measure one at a time (a lock beside the file): the
    second reads the first's table, so every node of a machine runs the same kernels (and numerics).
    """
    shapes, key = sorted(set(shapes)), machine_key(threads)
    with cache_lock(cache_path, block=True):
        cached = _read(cache_path).get(key, {})  # {machine key: table}: nodes of one machine may differ in threads
        missing = [s for s in shapes if f"{s[0]}x{s[1]}" not in cached.get("shapes", {})]
        if cached and not missing:
            return {**cached, "cached": True}
        table = save_table(cache_path, measure(missing, threads))
    return {**table, "cached": False}


def save_table(cache_path: str | None, table: dict) -> dict:
    """Merge ``table``'s shapes into the cached table of its machine key (atomically: never a half-written
    file; the caller holds ``cache_lock``); -> the merged table."""
    tables = _read(cache_path)
    merged = {**table, "shapes": {**tables.get(table["key"], {}).get("shapes", {}), **table["shapes"]}}
    if cache_path:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(cache_path)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": TABLE_VERSION, "tables": {**tables, table["key"]: merged}}, f, indent=1)
        os.replace(tmp, cache_path)
    return merged


def cache_lock(cache_path: str | None, block: bool):
    """The machine's measuring lock (``artefacts.machine_lock``, a file beside the cache): yields True if held,
    False if another process holds it and ``block`` is False. No cache path: nothing to share, always True."""
    return machine_lock(lock_path(cache_path), block)


def lock_path(cache_path: str | None) -> str | None:
    return cache_path + ".lock" if cache_path else None


def _read(cache_path: str | None) -> dict[str, dict]:
    """The cached tables by machine key ({} if none, unreadable, or of another version)."""
    if not cache_path or not os.path.exists(cache_path):
        return {}
    try:
        with open(cache_path) as f:
            t = json.load(f)
    except (OSError, ValueError):
        return {}
    ok = isinstance(t, dict) and t.get("version") == TABLE_VERSION and isinstance(t.get("tables"), dict)
    return {k: v for k, v in t["tables"].items() if isinstance(v, dict) and v.get("key") == k} if ok else {}
