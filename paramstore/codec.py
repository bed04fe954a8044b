"""Erasure coding of shards with zfec: k data + m parity fragments, any k rebuild the shard.

A shard of S bytes is zero-padded to k * L bytes (L = ceil(S / k)) and cut into
k data fragments of L bytes (memoryview slices, no copy); zfec computes the m
parity fragments. The codec names itself (``zfec-k8-n11``) so stored data
describes its own parameters, as Tahoe-LAFS does.

zfec pitfalls handled here: ``decode`` reorders the caller's lists in place (we
pass fresh lists) and loops forever on duplicate share numbers (we refuse them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import zfec

from .errors import InvalidRequest, NotEnoughFragments


class ErasureCodec:
    """k data + m parity fragments of equal length."""

    __slots__ = ("k", "m", "n", "_enc", "_dec")

    def __init__(self, k: int, m: int):
        if k < 1 or m < 0 or k + m > 256:
            raise InvalidRequest(f"invalid erasure code k={k} m={m}: need 1 <= k and k+m <= 256")
        self.k, self.m, self.n = k, m, k + m
        self._enc = zfec.Encoder(k, self.n) if m else None
        self._dec = zfec.Decoder(k, self.n) if m else None

    @property
    def name(self) -> str:
        return f"zfec-k{self.k}-n{self.n}"

    def fragment_size(self, size: int) -> int:
        """Bytes per fragment for a shard of `size` bytes (at least 1)."""
        return max(1, -(-size // self.k))

    def padded_size(self, size: int) -> int:
        return self.k * self.fragment_size(size)

    def data_views(self, buf: memoryview, frag: int) -> list[memoryview]:
        """The k data fragments as views of a padded buffer of k * frag bytes."""
        return [buf[i * frag : (i + 1) * frag] for i in range(self.k)]

    def encode(self, buf: memoryview, frag: int) -> list:
        """All n fragments of a padded buffer: k views of buf, then m new parity blocks."""
        data = self.data_views(buf, frag)
        if not self.m:
            return data
        parity = self._enc.encode(list(data), list(range(self.k, self.n)))
        return data + list(parity)

    def decode(self, blocks: Mapping[int, object], frag: int) -> list:
        """Any k fragments {index: bytes-like} -> the k data fragments, in order.

        Data fragments present are returned as given (zfec passes them through).
        """
        if len(blocks) < self.k:
            raise NotEnoughFragments("(decode)", self.k, len(blocks), {})
        nums = sorted(blocks)[: self.k]
        if len(set(nums)) != len(nums) or any(not 0 <= i < self.n for i in nums):
            raise InvalidRequest(f"invalid fragment indexes {nums}")
        for i in nums:
            if len(blocks[i]) != frag:
                raise InvalidRequest(f"fragment {i} has {len(blocks[i])} bytes, expected {frag}")
        if nums == list(range(self.k)):
            return [blocks[i] for i in nums]
        return list(self._dec.decode([blocks[i] for i in nums], list(nums)))

    def rebuild(self, blocks: Mapping[int, object], frag: int, wanted: Sequence[int]) -> dict[int, bytes]:
        """Recompute the fragments `wanted` (data or parity) from any k of `blocks`."""
        data = self.decode(blocks, frag)
        out: dict[int, bytes] = {}
        parity_wanted = [i for i in wanted if i >= self.k]
        for i in wanted:
            if i < self.k:
                out[i] = bytes(data[i])
        if parity_wanted:
            for i, blk in zip(parity_wanted, self._enc.encode(list(data), parity_wanted)):
                out[i] = bytes(blk)
        return out
