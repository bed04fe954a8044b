"""Paged KV cache: per layer, K and V in fixed-size blocks.

Layout, per layer ``l`` (views of one tensor ``kv: [L, 2, NB, BS, KVH, Dh]``,
the region ``compute.kv_transfer`` registers for NIXL)::

    k[l] = kv[l, 0], v[l] = kv[l, 1]: [num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block * block_size + offset``; a sequence's *block table*
lists its blocks in position order, so position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. Which blocks belong to
whom is the block manager's business; the cache only stores and gathers.
The seam for prefill/decode disaggregation is ``export_blocks`` /
``import_blocks``: they move whole blocks, every layer at once.
"""

from __future__ import annotations

import math
import mmap

import torch

from compute.modeling.config import ModelConfig


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor over its own anonymous mapping: the kernel hands out zero pages on first touch,
    so allocating a large cache costs nothing up front (``torch.zeros`` writes every byte: ~1-3 s for
    720 MiB on a busy 2-core box), and dropping the tensor unmaps it (the memory goes back at once)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n < 2**20:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)  # page-aligned; the tensor keeps the map


KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_dtype(choice: str, model_dtype: torch.dtype, int8_weights: bool) -> torch.dtype:
    """The cache dtype for ``choice`` (auto | bfloat16 | float32). ``auto``: bf16 (half the memory
    and gather traffic of fp32; attention runs in it) except for an all-fp32 runtime, which keeps
    fp32 end to end (the mode HF parity is checked in)."""
    if choice == "auto":
        return torch.float32 if model_dtype == torch.float32 and not int8_weights else torch.bfloat16
    if choice not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {choice!r}: auto | {' | '.join(KV_DTYPES)}")
    return KV_DTYPES[choice]


class KVCache:
    """K/V block storage for every layer of one model."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):  # fmt: skip
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # one region for the KV transfer layer to register: kv[l, 0] = K, kv[l, 1] = V of layer l
        if self.device.type == "cpu":
            self.kv = zeros_lazily(shape, dtype)  # [L, 2, NB, BS, KVH, Dh]
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k = self.kv[:, 0]  # [L, NB, BS, KVH, Dh] views; k[l] is contiguous
        self.v = self.kv[:, 1]
        kvh, dh = config.num_kv_heads, config.head_dim
        # per layer, views made once: K and V by slot [NB*BS, KVH, Dh]; both by slot [2, NB*BS, KVH*Dh]
        self._k_slots = [k.view(-1, kvh, dh) for k in self.k.unbind(0)]
        self._v_slots = [v.view(-1, kvh, dh) for v in self.v.unbind(0)]
        self._kv_slots = [kv.view(2, -1, kvh * dh) for kv in self.kv.unbind(0)]

    @classmethod
    def bytes_per_block(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Memory one block takes over all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [T, KVH, Dh]`` at ``slots: [T]`` of ``layer``."""
        self._k_slots[layer].index_copy_(0, slots, k.to(self.dtype))
        self._v_slots[layer].index_copy_(0, slots, v.to(self.dtype))

    def write_kv(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv: [T, 2 KVH, Dh]`` (K heads, then V heads) at ``slots: [T]`` of ``layer``: one copy for both."""
        t = kv.shape[0]
        src = kv.reshape(t, 2, -1).transpose(0, 1)  # [2, T, KVH*Dh]: a view where kv's rows are contiguous
        self._kv_slots[layer].index_copy_(1, slots, src if src.dtype == self.dtype else src.to(self.dtype))

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks: [..., nb]`` -> k, v ``[..., nb * block_size, KVH, Dh]`` (a copy)."""
        k, v = self.k[layer][blocks], self.v[layer][blocks]  # [..., nb, BS, KVH, Dh]
        return k.flatten(-4, -3), v.flatten(-4, -3)

    def gather_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``slots: [B, L]`` -> ``kv: [2, B, L, KVH, Dh]`` (K then V; one copy for both)."""
        flat = self._kv_slots[layer].index_select(1, slots.view(-1))  # [2, B*L, KVH*Dh]
        return flat.view(2, *slots.shape, *self.kv.shape[-2:])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to ``dst`` in every layer, K and V, for each ``(src, dst)`` (copy-on-write)."""
        if pairs:
            src, dst = (torch.tensor(c, dtype=torch.long, device=self.device) for c in zip(*pairs))
            self.kv[:, :, dst] = self.kv[:, :, src]

    def export_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy out ``blocks`` of every layer: k, v ``[L, len(blocks), BS, KVH, Dh]``."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return self.k[:, idx], self.v[:, idx]  # advanced indexing copies

    def import_blocks(self, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write exported ``k, v`` into ``blocks`` (same order) of every layer."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.k[:, idx] = k.to(self.device, self.dtype)
        self.v[:, idx] = v.to(self.device, self.dtype)
