"""INT4 weight quantization: asymmetric, groups of 32 along K, a scale and a zero per group (like Q4_1).

A 2-D weight ``w: [N, K]`` (HF ``[out, in]`` order, K % 32 == 0) is stored as three tensors:

- ``X.weight``: uint8 ``[N, K / 2]``, two 4-bit codes ``q`` in [0, 15] per byte: column ``2j`` in the low
  nibble of byte ``j``, column ``2j + 1`` in the high nibble;
- ``X.weight_scale``: bf16 ``[N, K / 32]``, the step of each group;
- ``X.weight_zero``: bf16 ``[N, K / 32]``, the value of the middle code 8 in each group,

with ``w[n, k] ~= (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``. This is a layout of our own, not a
CPU kernel's: the node repacks it at load for the kernel it runs (``compute.kernels.int4``). The scale and
zero are bf16 (4 bytes per 32 weights: 5 bits per weight in all, as Q4_1's fp16 pair) and the codes are
computed against the rounded bf16 values, so dequantization here equals the kernel's arithmetic.

The manifest's scheme is ``int4-asym-g32``. Which tensors: ``int4_eligible``. Everything else 2-D keeps the
int8 scheme (``paramstore.quant``), a weight whose K is not a multiple of 32 included.
"""

from __future__ import annotations

import torch

SCHEME = "int4-asym-g32"
GROUP = 32  # weights per (scale, zero) pair along K
ZERO_SUFFIX = "_zero"
MID = 8  # the code whose value is ``zero``
REFITS = 2  # least-squares refits of each group's zero to its codes (``quantize_int4``)


def quantize_int4(w: torch.Tensor, group: int = GROUP, refits: int = REFITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (packed: uint8 [N, K/2], scale: bf16 [N, K/group], zero: bf16 [N, K/group]).

    Each group's scale is its range over 15 steps, and its zero first the middle of that range; then, ``refits``
    times, the codes are taken and the zero refitted to them by least squares (the mean residual), rounded to bf16.
    bf16 keeps 8 bits of mantissa: rounding the pair alone moved each group's values by up to ~0.2% of its zero, a
    bias over 32 weights, which turned SmolLM2's greedy answer to "What is the capital of France?" into French
    (its Q4_1 source uses fp16 pairs); the refit brings it back, at perplexity within int8's (docs/engine.md)."""
    if w.dim() != 2:
        raise ValueError(f"int4 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 quantization needs K % {group} == 0, got K = {k}")
    wg = w.to(torch.float32).reshape(n, k // group, group)  # [N, G, group]
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)  # [N, G, 1]
    scale = ((hi - lo) / 15.0).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any step, q = 8 exactly
    s32 = scale.to(torch.float32)
    zero = (lo + MID * s32).to(torch.bfloat16)
    for i in range(refits + 1):
        q = torch.round((wg - zero.to(torch.float32)) / s32 + MID).clamp_(0, 15)
        if i < refits:
            zero = (wg - (q - MID) * s32).mean(-1, keepdim=True).to(torch.bfloat16)
    return pack(q.to(torch.uint8).reshape(n, k)), scale[..., 0].contiguous(), zero[..., 0].contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] codes in [0, 15] (any integer dtype) -> uint8 [N, K/2] (even column low nibble)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """(packed: uint8 [N, K/2], scale, zero: [N, G]) -> w: dtype [N, K]."""
    q = unpack(packed)
    n, k = q.shape
    group = k // scale.shape[1]
    s32, z32 = scale.to(torch.float32)[..., None], zero.to(torch.float32)[..., None]
    w = (q.reshape(n, k // group, group).to(torch.float32) - MID) * s32 + z32
    return w.reshape(n, k).to(dtype)


def int4_eligible(name: str, t: torch.Tensor, layer: int | None, group: int = GROUP) -> bool:
    """A decoder layer's linear weight (2-D float, K % group == 0). The embedding and the (often tied) lm_head
    stay int8: the embedding is read a row per token (no matmul to speed up), and a tied head is the same
    tensor; a separate head's logits are the output itself (held to int8's error)."""
    return layer is not None and t.dim() == 2 and t.is_floating_point() and name.endswith("weight") \
        and t.shape[1] % group == 0  # fmt: skip
