"""Fixed-size KV block allocation (no prefix caching).

A sequence owns ``ceil(tokens / block_size)`` blocks, listed in its
``block_table`` in position order. Blocks are only ever added at the end of a
table and are all returned at once by ``free`` (finish, abort, failure or
preemption). Invariant: ``num_free + sum(len(table)) == num_blocks``.
"""

from __future__ import annotations

from collections import deque

from compute.sequence import Sequence


class BlockManager:
    """Hands out block ids from a free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq``'s table can grow to hold ``num_tokens`` tokens."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s table to hold ``num_tokens`` tokens (no-op if it already does)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        assert need <= len(self._free), "allocate without can_allocate"
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more token fits (a decode step)."""
        return self.can_allocate(seq, seq.num_tokens)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_tokens)

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``."""
        self._free.extend(seq.block_table)
        seq.block_table = []
