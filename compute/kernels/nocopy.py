"""INT8-weight kernels that keep no float copy of the weight (``compute.kernels.int8`` measures them beside the others).

- ``w8a16``: the activation split per row into two int8 levels, one ``torch._int_mm`` (s8s8s32) over the 2M rows;
- ``otf_weight``: the int8 weight as bf16 in a reused per-thread buffer, for one bf16 GEMM (the ``otf`` kernel).

Their times against the bf16 copy, per SmolLM2 shape: ``pdserve bench weight-copies`` (benchmarks/weight_copies.py).
"""

from __future__ import annotations

import threading

import torch

_scratch = threading.local()  # per thread: a forward runs in one thread
SCRATCH_BYTES = 16 * 2**20  # the per-thread buffer a weight is converted into (``otf``) or dequantized into (``dequant``)


def scratch(dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` in this thread's reused buffer (no page faults of a fresh allocation), shared by
    every kernel that converts a weight before its GEMM: valid until the next call in this thread."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buf = _scratch.buf = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
    return buf[: shape.numel() * dtype.itemsize].view(dtype).view(shape)


W8A16_LO = 254.0  # the low int8 level's step is the high one's / 254: |x - a * hi| <= a / 2 -> |lo| <= 127


def w8a16(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float @ (q: [N, K] int8 * scale: [N])^T -> [M, N] fp32, on the int8 GEMM (``torch._int_mm``) and no
    float copy of the weight: each row of x is split into two int8 levels, x ~ a * (hi + lo / 254) with a = its
    absmax / 127 (resolution a / 254: ~20x finer than bf16's on outlier activations), and the 2M stacked rows go
    through one s8s8s32 GEMM. Integer products are exact and each row has its own scale, so every row's result
    is the same at any M (batch-invariant by construction, where ``_int_mm`` is exact: VNNI / AMX-int8)."""
    m = x.shape[0]
    x32 = x if x.dtype == torch.float32 else x.to(torch.float32)
    a = torch.linalg.vector_norm(x32, float("inf"), 1, keepdim=True).clamp_min_(1e-30).div_(127.0)  # [M, 1]
    t = x32 / a  # [M, K] in [-127, 127]
    levels = torch.empty(2 * m, x32.shape[1])
    hi = torch.round(t, out=levels[:m])
    torch.sub(t, hi, out=levels[m:]).mul_(W8A16_LO).round_()  # t - hi is exact, in [-0.5, 0.5]
    acc = torch._int_mm(levels.to(torch.int8), q.t())  # [2M, N] int32
    return acc[m:].to(torch.float32).div_(W8A16_LO).add_(acc[:m]).mul_(a).mul_(scale)


_OTF_MAX = SCRATCH_BYTES // 2  # elements (16 MiB of bf16): the largest weight ``otf`` converts into the scratch


def otf_weight(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] int8 as bf16 (exact: |q| <= 127) in a reused per-thread buffer, for the ``otf`` kernel (the scale is
    applied to its output): no resident copy. Valid until the next call in this thread."""
    return scratch(torch.bfloat16, q.shape).copy_(q)
