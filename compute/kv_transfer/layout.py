"""What a KV cache looks like to the transfer layer: one registered region of blocks.

Cache tensor (one per engine, the region NIXL registers once)::

    kv: [num_layers, 2, num_blocks, block_size, n_kv_heads, head_dim]   # 2 = (K, V)
    k[l] = kv[l, 0]: [num_blocks, block_size, n_kv_heads, head_dim]    # contiguous per layer
    v[l] = kv[l, 1]

The engine allocates it with ``KVPool.allocate(layout, num_blocks)`` and uses
``pool.k`` / ``pool.v`` exactly as it used its own per-layer K/V tensors. A
permuted view of another contiguous tensor is accepted too (for instance
block-major storage ``[num_blocks, layers, 2, ...]`` viewed as above, which puts
every layer of a block next to each other and so needs fewer descriptors); the
only rules are: the view covers its whole storage and each (layer, K|V, block)
unit ``[block_size, n_kv_heads, head_dim]`` is contiguous.

The unit of transfer is one (layer, K|V, block): ``layout.block_nbytes`` bytes.
A request's units are listed in *canonical order* ``(layer, kv, i)`` with ``i``
the position in its block list; both sides walk that order, so a byte stream
(tcp) or a descriptor list (nixl) lines up without sending block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one model's paged KV cache (the same on prefill and decode)."""

    num_layers: int  # transformer layers
    block_size: int  # tokens per block
    n_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # channels per head
    dtype: torch.dtype = torch.float32  # cache dtype; a name ("bfloat16") is accepted

    def __post_init__(self):
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ValueError(f"unsupported KV dtype {self.dtype!r}")
            object.__setattr__(self, "dtype", _DTYPES[self.dtype])
        for name in ("num_layers", "block_size", "n_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVLayout.{name} must be > 0")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one unit: one block of K (or V) of one layer."""
        return self.block_size * self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes of one block of one layer, K and V."""
        return 2 * self.block_nbytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, K and V."""
        return self.num_layers * self.bytes_per_block_per_layer

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.n_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "block_size": self.block_size, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype)}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**d)


@dataclass(frozen=True, slots=True)
class BlockRegion:
    """Byte geometry of a region of (layer, kv, block) units: where each unit starts.

    Describes the KV cache and the compressed staging buffers alike; it is what
    the nixl handle carries so the reader can compute the remote descriptors.
    """

    base: int  # address of the region's first byte
    nbytes: int  # region size
    strides: tuple[int, int, int]  # bytes between consecutive layers, K|V, blocks
    unit_nbytes: int  # bytes of one unit
    num_layers: int
    num_blocks: int

    @classmethod
    def of(cls, t: torch.Tensor) -> BlockRegion:
        """The region of ``t: [L, 2, NB, ...unit]`` (a view covering its whole storage)."""
        isz = t.element_size()
        unit = t[0, 0, 0].numel() * isz
        return cls(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(),
                   (t.stride(0) * isz, t.stride(1) * isz, t.stride(2) * isz), unit, t.shape[0], t.shape[2])  # fmt: skip

    def offsets(self, blocks: list[int]) -> np.ndarray:
        """Byte offset of each unit of ``blocks`` in canonical order: int64 ``[L * 2 * n]``."""
        sl, skv, sb = self.strides
        b = np.asarray(blocks, dtype=np.int64) * sb
        lk = (np.arange(self.num_layers, dtype=np.int64)[:, None] * sl + np.arange(2, dtype=np.int64)[None] * skv)
        return (lk.reshape(-1, 1) + b[None]).reshape(-1)

    def segments(self, blocks: list[int]) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` runs covering ``blocks`` in canonical order, adjacent units merged."""
        return runs(self.offsets(blocks), self.unit_nbytes)

    def to_dict(self) -> dict:
        return {"base": self.base, "nbytes": self.nbytes, "strides": list(self.strides),
                "unit_nbytes": self.unit_nbytes, "num_layers": self.num_layers, "num_blocks": self.num_blocks}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> BlockRegion:
        return cls(d["base"], d["nbytes"], tuple(d["strides"]), d["unit_nbytes"], d["num_layers"], d["num_blocks"])


def runs(offsets: np.ndarray, unit: int) -> list[tuple[int, int]]:
    """Merge units at ``offsets`` (in order) into ``(offset, nbytes)`` runs."""
    if len(offsets) == 0:
        return []
    cut = np.flatnonzero(np.diff(offsets) != unit) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(offsets)]))
    return [(int(offsets[s]), int(e - s) * unit) for s, e in zip(starts, ends)]


def paired_runs(src: np.ndarray, dst: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge units that are adjacent on *both* sides: ``(src_off, dst_off, nbytes)`` arrays."""
    if len(src) == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    cut = np.flatnonzero((np.diff(src) != unit) | (np.diff(dst) != unit)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(src)]))
    return src[starts], dst[starts], (ends - starts).astype(np.int64) * unit


def flat_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of ``t``'s whole storage (no copy)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (n,), (1,), 0).view(torch.uint8).numpy()


class KVPool:
    """The engine's KV cache as the transfer layer sees it: one tensor, one region."""

    def __init__(self, layout: KVLayout, tensor: torch.Tensor):
        if tensor.device.type != "cpu":
            raise ValueError("KVPool holds CPU tensors only")
        if tensor.dtype != layout.dtype:
            raise ValueError(f"cache dtype {tensor.dtype} != layout dtype {layout.dtype}")
        if tensor.dim() != 6 or tuple(tensor.shape[:2]) != (layout.num_layers, 2) \
                or tuple(tensor.shape[3:]) != layout.shape(0)[3:]:  # fmt: skip
            raise ValueError(f"cache shape {tuple(tensor.shape)} is not {layout.shape(-1)} (NB=-1)")
        unit = tensor[0, 0, 0]
        if not unit.is_contiguous() or tensor.storage_offset() != 0 \
                or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():  # fmt: skip
            raise ValueError("cache must cover its whole storage with contiguous [block_size, heads, dim] units")
        order = sorted(range(6), key=lambda d: -tensor.stride(d))
        if not tensor.permute(order).is_contiguous():
            raise ValueError("cache must be a permuted view of one contiguous tensor (one region)")
        self.layout, self.tensor = layout, tensor
        self.num_blocks = tensor.shape[2]
        self.region = BlockRegion.of(tensor)

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int) -> KVPool:
        """A zeroed cache ``[L, 2, num_blocks, BS, KVH, Dh]`` in the recommended layout."""
        return cls(layout, torch.zeros(layout.shape(num_blocks), dtype=layout.dtype))

    @property
    def k(self) -> torch.Tensor:
        """``[L, NB, BS, KVH, Dh]``: ``k[l]`` is layer ``l``'s key blocks (a view)."""
        return self.tensor[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.tensor[:, 1]

    def check_blocks(self, blocks: list[int]) -> list[int]:
        blocks = [int(b) for b in blocks]
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"block ids must be unique and in [0, {self.num_blocks}): {blocks}")
        return blocks

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """A copy of ``blocks``: ``[L, 2, n, BS, KVH, Dh]``."""
        return self.tensor[:, :, torch.tensor(blocks, dtype=torch.long)]

    def scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write ``data: [L, 2, n, BS, KVH, Dh]`` into ``blocks`` (same order)."""
        self.tensor[:, :, torch.tensor(blocks, dtype=torch.long)] = data.to(self.layout.dtype)
