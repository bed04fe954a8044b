"""Wire compression of KV blocks: none, bf16, fp16, int8 (per token and head scales, channel-smoothed).

A codec maps units ``[..., block_size, n_kv_heads, head_dim]`` of the cache
dtype to bytes ``uint8 [..., wire_nbytes(layout)]`` and back. Each encoded unit
is self-contained, so encoded units sit in a staging region with the same
(layer, kv, block) geometry as the cache::

    int8 unit = q int8 [BS * KVH * Dh] ++ scale fp32 [BS * KVH] ++ channel fp16 [KVH * Dh]
                c = absmax(x over the block's tokens), q = round(x / c / scale),
                scale = absmax(x / c over head_dim) / 127

Error bounds (per element): bf16 |e| <= 2^-8 |x|, fp16 |e| <= 2^-11 |x| (values
beyond 65504 saturate to inf: KV rarely gets there), int8 |e| <= c * absmax(x / c) / 254.
A codec that cannot shrink the cache dtype (bf16 of a bf16 cache) is the
identity. The nixl backend stages encoded units on the prefill side at
``offer`` (READ is one-sided: nothing runs on the prefill node during the read);
tcp encodes while streaming.
"""

from __future__ import annotations

import abc

import torch

from compute.kv_transfer.layout import KVLayout


class Codec(abc.ABC):
    name: str

    @abc.abstractmethod
    def wire_nbytes(self, layout: KVLayout) -> int:
        """Encoded bytes of one unit (one layer's K or V of one block)."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., BS, KVH, Dh]`` -> ``uint8 [..., wire_nbytes]`` (new tensor)."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        """``uint8 [..., wire_nbytes]`` -> ``[..., BS, KVH, Dh]`` in ``layout.dtype``."""

    def ratio(self, layout: KVLayout) -> float:
        return layout.block_nbytes / self.wire_nbytes(layout)


def _unit(layout: KVLayout) -> tuple[int, int, int]:
    return layout.block_size, layout.n_kv_heads, layout.head_dim


class NoCompression(Codec):
    name = "none"

    def wire_nbytes(self, layout):
        return layout.block_nbytes

    def encode(self, x):
        return x.contiguous().view(torch.uint8).flatten(-3)

    def decode(self, payload, layout):
        return payload.contiguous().view(layout.dtype).unflatten(-1, _unit(layout))


class Cast(Codec):
    """Send in a 2-byte float dtype (identity when the cache is not wider)."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def _wire_dtype(self, layout):
        return self.dtype if layout.itemsize > 2 else layout.dtype

    def wire_nbytes(self, layout):
        return layout.block_size * layout.n_kv_heads * layout.head_dim * min(layout.itemsize, 2)

    def encode(self, x):
        wire = self.dtype if x.element_size() > 2 else x.dtype
        return x.to(wire).contiguous().view(torch.uint8).flatten(-3)

    def decode(self, payload, layout):
        return payload.contiguous().view(self._wire_dtype(layout)).unflatten(-1, _unit(layout)).to(layout.dtype)


class Int8(Codec):
    """Symmetric int8, one fp32 scale per (token, head), after per-channel smoothing.

    K carries a few large channels (RoPE pairs, outlier dims) that set every token's
    absmax and crush the other channels to a handful of levels. Each unit is first
    divided by its per-(head, channel) absmax over the block's tokens (fp16 factors, as
    SmoothQuant / KIVI's per-channel K do), then quantized per (token, head). Measured on
    SmolLM2 (teacher-forced top-1 agreement vs uncompressed, 6 chat prompts): plain
    per-(token, head) int8 94.4%, smoothed 98.1%, fp16 97.2%, bf16 99.1%.
    """

    name = "int8"

    def wire_nbytes(self, layout):
        bs, h, d = _unit(layout)
        return bs * h * (d + 4) + h * d * 2

    def encode(self, x):
        xf = x.float()  # [..., BS, KVH, Dh]
        ch = xf.abs().amax(-3, keepdim=True).to(torch.float16).float()  # [..., 1, KVH, Dh]
        ch = torch.where(ch > 0, ch, torch.ones_like(ch))
        xs = xf / ch
        scale = xs.abs().amax(-1, keepdim=True) / 127.0  # [..., BS, KVH, 1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (xs / scale).round_().clamp_(-127, 127).to(torch.int8)
        q = q.flatten(-3).view(torch.uint8)  # [..., BS*KVH*Dh]
        s = scale.flatten(-3).contiguous().view(torch.uint8)  # [..., BS*KVH*4]
        c = ch.to(torch.float16).flatten(-3).contiguous().view(torch.uint8)  # [..., KVH*Dh*2]
        return torch.cat((q, s, c), -1)

    def decode(self, payload, layout):
        bs, h, d = _unit(layout)
        nq, ns = bs * h * d, bs * h * 4
        q = payload[..., :nq].contiguous().view(torch.int8).unflatten(-1, (bs, h, d))
        s = payload[..., nq : nq + ns].contiguous().view(torch.float32).unflatten(-1, (bs, h, 1))
        c = payload[..., nq + ns :].contiguous().view(torch.float16).unflatten(-1, (1, h, d))
        return (q.float() * s * c.float()).to(layout.dtype)


CODECS: dict[str, Codec] = {c.name: c for c in (NoCompression(), Cast("bf16", torch.bfloat16),
                                                   Cast("fp16", torch.float16), Int8())}  # fmt: skip


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown KV compression {name!r}; choose from {sorted(CODECS)}")
    return CODECS[name]
