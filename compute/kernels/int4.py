"""INT4-weight linears: the store's ``int4-asym-g32`` weights (``paramstore.quant4``) on torch's CPU int4 kernel.

At load the stored layout (codes two per byte ``[N, K/2]``, bf16 ``scale`` / ``zero`` ``[N, K/32]``,
``w = (q - 8) * scale + zero``) is repacked once for ``torch.ops.aten._weight_int4pack_mm_for_cpu``:

- the codes through ``torch._convert_weight_to_int4pack_for_cpu`` (int32 ``[N, K]`` in, uint8 ``[N, K/2]`` out: the
  same bytes as stored, in the kernel's own order, an implementation detail of torch that is never stored);
- scale and zero stacked as the kernel's ``[K/32, N, 2]`` bf16 (its convention is the store's: the middle code 8
  dequantizes to ``zero``; verified against ``dequantize_int4`` in tests/compute/kernels/test_int4.py).

Memory stays at the int4 size: 0.5 byte per weight + 4 bytes per group of 32 (the stored tensors are released
once repacked; a ``LinearPart`` keeps views of its fused linear's repacked rows). The kernel runs at every M (no
kernel table: ``compute.kernels.int8`` plans only int8 weights). Measured on a 2-core AMD EPYC (Zen 4,
avx512_bf16 / avx512_vnni), torch 2.13, 2 threads, min of 15, us (``int8mm`` the int8 kernel on the same shape)::

    N x K          M = 1   int8mm    M = 8   int8mm    M = 32  int8mm    M = 512  int8mm  bf16 F.linear
    576 x 576         12       12       35       38       126     144       2079    2314      794
    3072 x 576        49       50      169      194       777     858      19742   26110    13289
    49152 x 576     5824     7923     7714    15509     23845   47854          -       -        -

so int4mm is at least int8mm's speed everywhere; a bf16 ``F.linear`` (a resident bf16 copy: 4x the int4 bytes)
wins from M ~ 32 on. The copy is opt-in: only within an explicit ``[node] weight_copies_gb`` budget (what the int8
plan's copies leave of it), only under ``kernels = measured``, and only for a shape where this machine measures
bf16 ``F.linear`` faster than int4mm at M = ``PROBE_M`` (``copy_faster``; an AVX2 CPU emulates bf16 and loses);
such a linear runs the copy above ``COPY_MIN_M`` rows and int4mm at and below it. Otherwise memory stays at the
int4 size (``Transformer.use_int4_copies``).

Only on the CPU: on another device the loader dequantizes int4 weights to the activation dtype at load
(``compute.modeling.loader``), a float model there.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from compute.errors import WeightMismatch
from paramstore.quant4 import GROUP, unpack

COPY_MIN_M = 8  # an int4 linear with a bf16 copy runs the copy above this many rows (int4mm wins at M <= 8 above)
PROBE_M = 256  # the M ``copy_faster`` compares the two at (prefill-sized)
INNER_K_TILES = 2  # the CPU pack ignores it (any of 2, 4, 8 gives the same bytes); the op requires one


def kernel_available() -> bool:
    """Whether this torch has the CPU int4 kernel (torch >= 2.5)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def repack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored (packed: uint8 [N, K/2], scale, zero: [N, K/32]) -> (the kernel's uint8 [N, K/2], scale_zero bf16
    [K/32, N, 2]). The codes pass through a transient int32 [N, K] (8x the packed bytes, freed on return)."""
    if packed.device.type != "cpu":
        raise ValueError(f"the int4 kernel runs on the CPU only, got a weight on {packed.device}")
    if not kernel_available():
        raise RuntimeError(f"torch {torch.__version__} has no CPU int4 kernel: import the model as int8")
    w = torch._convert_weight_to_int4pack_for_cpu(unpack(packed).to(torch.int32), INNER_K_TILES)
    sz = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], -1).transpose(0, 1).contiguous()
    return w, sz


def repack_or_mismatch(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``repack`` for a model's load: what it cannot do is the weights' mismatch with this machine."""
    try:
        return repack(w, scale, zero)
    except (ValueError, RuntimeError) as e:
        raise WeightMismatch(str(e)) from None


def output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, cast: bool) -> torch.Tensor:
    """The int4 path's bf16 output in x's dtype (``cast=False``: as is, ``compute.kernels.linear.matmul``) + bias."""
    y = y if y.dtype == x.dtype or not cast else y.to(x.dtype)
    return y if bias is None else y + bias


def scale_zero_views(sz: torch.Tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) ``[N, K/32]`` of ``rows`` as views of the kernel's ``[K/32, N, 2]`` (no copy)."""
    return sz[:, rows, 0].t(), sz[:, rows, 1].t()


def matmul(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float @ the repacked int4 weight [N, K/2] -> [M, N] bf16 (the kernel's fast path takes bf16 x)."""
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), w, GROUP, sz)


def dequantized(w: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The repacked weight back as [N, K] ``dtype``, through the kernel itself (x = identity): for tests and tools,
    independent of the kernel's packing order. Exact up to bf16 rounding of each value."""
    k = sz.shape[0] * GROUP
    return matmul(torch.eye(k, dtype=torch.bfloat16), w, sz).t().to(dtype).contiguous()


def run(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, copy: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] -> [M, N] bf16: int4mm, or above ``COPY_MIN_M`` rows the bf16 ``copy`` [N, K] where one is kept."""
    if copy is not None and x.shape[0] > COPY_MIN_M:
        return F.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), copy)
    return matmul(x, w, sz)


_FASTER: dict[tuple[int, int, int], bool] = {}  # (N, K, threads) -> whether the bf16 copy wins at PROBE_M


def copy_faster(n: int, k: int, repeats: int = 5) -> bool:
    """Whether bf16 ``F.linear`` beats int4mm on an [N, K] weight at M = ``PROBE_M`` on this machine (min of
    ``repeats`` interleaved runs each, random weights; measured once per shape and thread count in a process)."""
    key = (n, k, torch.get_num_threads())
    if key not in _FASTER:
        gen = torch.Generator().manual_seed(0)
        w, sz = repack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                       torch.rand(n, k // GROUP, generator=gen), torch.randn(n, k // GROUP, generator=gen))  # fmt: skip
        copy = dequantized(w, sz, torch.bfloat16)
        x = torch.randn(PROBE_M, k, generator=gen).to(torch.bfloat16)
        best = {"int4": float("inf"), "bf16": float("inf")}
        for _ in range(repeats):
            for name, fn in (("int4", lambda: matmul(x, w, sz)), ("bf16", lambda: F.linear(x, copy))):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        _FASTER[key] = best["bf16"] < best["int4"]
    return _FASTER[key]
