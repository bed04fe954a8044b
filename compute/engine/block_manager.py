"""Fixed-size KV block allocation: shared blocks, and full blocks kept by their content (prefix cache).

A sequence owns ``ceil(tokens / block_size)`` blocks, listed in its ``block_table`` in position
order. Blocks are only ever added at the end of a table and are all returned at once by ``free``
(finish, abort, failure or preemption). A block may be in several tables: each block counts the
tables (and held lists) it is in, and is free when the count is 0. One mechanism serves both
kinds of sharing (``share``): the choices of one ``n > 1`` request start from their prompt's full
blocks, and a new sequence starts from cached blocks whose content matches its prompt.

Lifecycle of a block::

    free (plain) --allocate--> held by tables --publish(hash)--> held, hashed
         ^                                                         |  ^
         |                                          last table lets go  share (a hit)
         +--evict (LRU, its hash dropped)-- free (cached, hash kept) --+

Only a full block whose K/V are all computed gets a hash (``publish``; the scheduler decides which),
so a hashed block is never written again: whoever shares it has computed (or taken) every token up
to its end, and the one partial block a table may end with is never shared (a fork copies it).
``allocate`` takes plain free blocks first, then evicts cached ones, least recently freed first;
a table is let go of tail first, so a request's last blocks are evicted before its first (a later
prompt is likelier to share a short prefix than a long one).

Invariant (``check``): ``num_free + |distinct blocks in tables and held| == num_blocks``, where
free counts plain and cached blocks (a cached block is free: evictable at any allocation).

Cache events (stored / removed / cleared block hashes) queue in ``events`` (bounded: a consumer
that finds ``events_dropped`` grown must resync from ``cached_hashes()``) for a node API to drain.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from compute.engine.sequence import Sequence

MAX_EVENTS = 4096  # queued cache events at most; older ones are dropped (and counted)


@dataclass(slots=True)
class CacheEvent:
    """What changed in the cache: ``kind`` stored | removed | cleared, and the block hashes (none for cleared)."""

    kind: str
    hashes: list[bytes]


class BlockManager:
    """Hands out block ids; counts the tables each block is in; keeps hashed free blocks until evicted."""

    def __init__(self, num_blocks: int, block_size: int, max_events: int = MAX_EVENTS) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self._plain: deque[int] = deque(range(num_blocks))  # free, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, hashed: the first is evicted next
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its content hash (held or cached)
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self.events: deque[CacheEvent] = deque(maxlen=max_events)
        self.events_dropped = 0  # events pushed out of the full queue since start
        self.evictions = 0  # cached blocks reused for other content since start

    @property
    def num_free(self) -> int:
        """Blocks free to allocate: plain ones and cached ones (evicted on demand)."""
        return len(self._plain) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks that have a hash (free or in a table): what a new prompt can hit."""
        return len(self._block_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int, hit: list[int] = ()) -> bool:
        """Whether ``seq``'s table (started with the cached blocks ``hit``, if given) can grow to ``num_tokens``."""
        taken_free = sum(self._refs[b] == 0 for b in hit)  # a free cached block a hit takes is not free to allocate
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(hit)
        return need <= self.num_free - taken_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s table to hold ``num_tokens`` tokens (no-op if it already does)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        assert need <= self.num_free, "allocate without can_allocate"
        for _ in range(need):
            b = self._take_free()
            self._refs[b] = 1
            seq.block_table.append(b)

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more token fits (a decode step)."""
        return self.can_allocate(seq, seq.num_tokens)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_tokens)

    def share(self, blocks: list[int], seq: Sequence) -> None:
        """Start ``seq``'s (empty) table with ``blocks``: full ones other tables hold, or cached free ones."""
        assert not seq.block_table, "share into an empty table"
        seq.block_table = self.pin(blocks)

    def pin(self, blocks: list[int]) -> list[int]:
        """Count one more holder of ``blocks`` (held ones, or cached free ones: taken off the free list);
        returns them. ``release`` lets go. A table's ``share`` and a peer export's hold are this."""
        for b in blocks:
            if self._refs[b] == 0:
                assert b in self._cached, f"block {b} is free and not cached"
                del self._cached[b]
            self._refs[b] += 1
        return list(blocks)

    def take(self, n: int) -> list[int]:
        """``n`` fresh blocks outside any table (a pre-pull's landing place), counted once; ``release`` lets go."""
        assert n <= self.num_free, "take without room"
        out = [self._take_free() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def refs(self, block: int) -> int:
        """How many tables (or held lists) hold ``block``."""
        return self._refs[block]

    def free(self, seq: Sequence) -> None:
        """Let go of every block of ``seq`` (a block shared with another table stays theirs)."""
        self.release(seq.block_table)
        seq.block_table = []

    def release(self, blocks: list[int]) -> None:
        """Let go of ``blocks`` taken out of a table (held for a KV transfer); the tail first."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released twice"
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None  # most recently used: evicted last
                else:
                    self._plain.append(b)

    # -- the prefix cache --------------------------------------------------------------------

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of ``hashes`` from the first (a chain: the first miss ends it)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def publish(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Name full, computed ``blocks`` (held by a table) by their content. A hash another block already
        has is left (the block stays unnamed and goes back plain); a named block keeps its name."""
        stored = []
        for b, h in zip(blocks, hashes):
            assert self._refs[b] > 0, f"publish of free block {b}"
            if b in self._hash_of or h in self._block_of:
                continue
            self._hash_of[b], self._block_of[h] = h, b
            stored.append(h)
        if stored:
            self._event("stored", stored)

    def cached_hashes(self) -> list[bytes]:
        """Every hash a prompt can hit now (a resync after dropped events)."""
        return list(self._block_of)

    def clear(self) -> int:
        """Forget every hash (the KV numbers changed: another kernel plan, new weights); returns how many."""
        n = len(self._block_of)
        self._plain.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._event("cleared", [])
        return n

    def drain_events(self) -> list[CacheEvent]:
        """The queued events, oldest first; the queue is empty after."""
        out = list(self.events)
        self.events.clear()
        return out

    def check(self, tables: list[list[int]] | None = None) -> None:
        """Assert the invariants; with ``tables`` (every table and held list), that each block's count is its
        number of appearances in them. For tests after aborts, preemption and failover."""
        free = set(self._plain) | set(self._cached)
        assert len(free) == len(self._plain) + len(self._cached), "a block is free twice"
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert not free & held, f"blocks {sorted(free & held)} are free and held"
        assert len(free) + len(held) == self.num_blocks, f"{self.num_blocks - len(free) - len(held)} blocks leaked"
        assert all(b in self._hash_of for b in self._cached), "a cached free block has no hash"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
        assert len(self._hash_of) == len(self._block_of), "hash maps disagree"
        if tables is not None:
            counts = [0] * self.num_blocks
            for t in tables:
                for b in t:
                    counts[b] += 1
            bad = [b for b in range(self.num_blocks) if counts[b] != self._refs[b]]
            assert not bad, f"blocks {bad[:8]} counted {[self._refs[b] for b in bad[:8]]}, in {[counts[b] for b in bad[:8]]} tables"

    # -- internals ---------------------------------------------------------------------------

    def _take_free(self) -> int:
        if self._plain:
            return self._plain.popleft()
        b, _ = self._cached.popitem(last=False)  # least recently freed (a request's tail before its head)
        h = self._hash_of.pop(b)
        del self._block_of[h]
        self.evictions += 1
        self._event("removed", [h])
        return b

    def _event(self, kind: str, hashes: list[bytes]) -> None:
        if len(self.events) == self.events.maxlen:
            self.events_dropped += 1
        self.events.append(CacheEvent(kind, hashes))
