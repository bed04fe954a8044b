"""Fixed-size KV block allocation with shared blocks (no prefix caching).

A sequence owns ``ceil(tokens / block_size)`` blocks, listed in its
``block_table`` in position order. Blocks are only ever added at the end of a
table and are all returned at once by ``free`` (finish, abort, failure or
preemption). A block may be in several tables: the choices of one ``n > 1``
request share their prompt's full blocks (``share``); each block counts its
tables and goes back to the free list when the last one lets go. A shared block
is never written again (only full blocks are shared; a partial one is copied:
``Scheduler.fork``). Invariant: ``num_free + |distinct blocks in tables and held| == num_blocks``.
"""

from __future__ import annotations

from collections import deque

from compute.engine.sequence import Sequence


class BlockManager:
    """Hands out block ids from a free list; counts the tables each block is in."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

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
            b = self._free.popleft()
            self._refs[b] = 1
            seq.block_table.append(b)

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more token fits (a decode step)."""
        return self.can_allocate(seq, seq.num_tokens)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_tokens)

    def share(self, blocks: list[int], seq: Sequence) -> None:
        """Start ``seq``'s (empty) table with ``blocks``, which other tables hold too (full ones only)."""
        assert not seq.block_table, "share into an empty table"
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free"
            self._refs[b] += 1
        seq.block_table = list(blocks)

    def refs(self, block: int) -> int:
        """How many tables (or held lists) hold ``block``."""
        return self._refs[block]

    def free(self, seq: Sequence) -> None:
        """Let go of every block of ``seq`` (a block shared with another table stays theirs)."""
        self.release(seq.block_table)
        seq.block_table = []

    def release(self, blocks: list[int]) -> None:
        """Let go of ``blocks`` taken out of a table (held for a KV transfer)."""
        for b in blocks:
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released twice"
            if self._refs[b] == 0:
                self._free.append(b)
