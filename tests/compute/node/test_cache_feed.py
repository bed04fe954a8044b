"""The node's cache log (compute/node/cache_feed.py) over a real block manager: consumers follow it from
their cursors; a new one, one of another epoch, one the log no longer reaches, or any after a drop gets a
snapshot; the net change of a range is what folding every event gives."""

from __future__ import annotations

import asyncio
import types

from compute.engine.block_manager import BlockManager
from compute.node import protocol as P
from compute.node.cache_feed import CacheFeed


class BlocksEngine:
    """The engine's cache verbs (compute/engine/engine.py) over a real block manager: all the feed reads."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.block_size, self.cache_extra, self.prefix_cache_enabled = blocks.block_size, ("model=t",), True

    def drain_cache_events(self):
        return self.blocks.drain_events()

    @property
    def events_dropped(self) -> int:
        return self.blocks.events_dropped

    def cached_hashes(self):
        return self.blocks.cached_hashes()


class InlineWorker:
    """The engine thread, run inline: ``call(fn)`` is fn(engine)."""

    def __init__(self, blocks: BlockManager):
        self.engine = BlocksEngine(blocks)

    async def call(self, fn):
        return fn(self.engine)


def store(bm: BlockManager, n: int, tag: int) -> list[bytes]:
    """A sequence of ``n`` full blocks published and freed (cached); -> their hashes."""
    seq = types.SimpleNamespace(block_table=[])
    bm.allocate(seq, n * bm.block_size)
    hs = [bytes([tag, i]) * 16 for i in range(n)]
    bm.publish(seq.block_table, hs)
    bm.free(seq)
    return hs


def fold(state: set, mc: P.ModelCache) -> set:
    if mc.resync or mc.cleared:
        state = set()
    return (state - set(mc.removed)) | set(mc.stored)


def snapshot(bm) -> set:
    return set(bm.cached_hashes())


def test_two_consumers_follow_the_log_and_their_folds_equal_the_cache():
    async def go():
        bm = BlockManager(8, 4)
        feed = CacheFeed(InlineWorker(bm))
        a = await feed.report(None)
        assert a.resync and a.stored == [] and a.block_size == 4 and a.extra == ["model=t"]
        sa = fold(set(), a)
        store(bm, 3, 1)
        b = await feed.report(None)  # a second consumer, later: a snapshot
        sb = fold(set(), b)
        store(bm, 6, 2)  # evicts some of the first: removed events
        store(bm, 2, 3)
        ra = await feed.report(a.cursor)
        assert not ra.resync and ra.cursor.seq > a.cursor.seq
        assert not set(ra.stored) & set(ra.removed)
        sa, sb = fold(sa, ra), fold(sb, await feed.report(b.cursor))
        assert sa == sb == snapshot(bm) and bm.evictions > 0
        bm.clear()
        rc = await feed.report(ra.cursor)
        assert rc.cleared and fold(sa, rc) == snapshot(bm) == set()

    asyncio.run(go())


def test_snapshot_for_another_epoch_a_forgotten_cursor_or_after_dropped_events():
    async def go():
        bm = BlockManager(64, 4, max_events=2)
        feed = CacheFeed(InlineWorker(bm), max_log=4)
        first = await feed.report(None)
        store(bm, 1, 1)
        r = await feed.report(P.CacheCursor("another-engine", first.cursor.seq))
        assert r.resync and set(r.stored) == snapshot(bm)
        cur = r.cursor
        for tag in range(2, 5):  # 3 events, 2 kept by the engine's queue: one dropped
            store(bm, 1, tag)
        r = await feed.report(cur)
        assert r.resync and set(r.stored) == snapshot(bm)
        cur = r.cursor
        for tag in range(5, 7):
            store(bm, 1, tag)
            await feed.report(r.cursor)  # another consumer keeps the log moving
        for tag in range(7, 10):
            store(bm, 1, tag)
            r = await feed.report(r.cursor)
        old = await feed.report(cur)  # 5 events on: past the log's 4
        assert old.resync and set(old.stored) == snapshot(bm)

    asyncio.run(go())
