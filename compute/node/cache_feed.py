"""One model's prefix-cache log on its node: the engine's cache events numbered, served to every consumer
(the gateway's prefix index, compute/node/protocol.py ``CacheReport``) from a cursor of its own.

Lifecycle of a change:

1. the engine's block manager queues a ``CacheEvent`` (stored / removed / cleared; its queue is bounded
   and counts what it dropped: compute/engine/block_manager.py);
2. a consumer asks (POST /internal/cache): the engine thread drains that queue into this log (``pull``),
   each event numbered by the next ``seq``. A drop seen there (``events_dropped`` grew) is a gap: every
   cursor before it can no longer be followed;
3. the consumer gets the net change from its cursor to the head, or a full snapshot (``resync``: the
   engine's ``cached_hashes()``, taken on the engine thread in the same call as the drain, so it is the
   state at exactly that head) when its cursor is of another epoch (another engine: the model reloaded,
   the node restarted), older than the log keeps, or before a gap;
4. it folds the report and asks again from the cursor it got.

Several consumers (two gateways; one restarted) keep a cursor each: a query drains the engine's queue,
never this log, which keeps the last ``MAX_LOG`` events. Why a route the consumer polls, not /load: /load
is read by the autoscaler, the pool and status pages too, and must stay a pure reading; a pull also means
a node never holds a connection per consumer, and a consumer that stops asking costs the node nothing.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque

from compute.node import protocol as P

MAX_LOG = 8192  # events kept for consumers to follow; a cursor older than the oldest gets a snapshot
PULL_TIMEOUT_S = 5.0  # the engine thread answers between two steps; a stopped one never does


class CacheFeed:
    """The log of one engine's cache events; ``report(cursor)`` is a consumer's next ``ModelCache``."""

    def __init__(self, worker, max_log: int = MAX_LOG) -> None:
        e = worker.engine
        self.worker = worker
        self.block_size, self.extra, self.enabled = e.block_size, list(e.cache_extra), e.prefix_cache_enabled
        self.epoch = secrets.token_hex(8)  # this engine's log: a cursor of another epoch is resynced
        self.log: deque[tuple[int, str, list[bytes]]] = deque(maxlen=max_log)  # (seq, kind, hashes)
        self.seq = 0  # the last event's number
        self.gap = 0  # a cursor below this missed events the engine dropped
        self._dropped = 0  # the engine's events_dropped at the last pull
        self._lock = asyncio.Lock()  # one pull at a time: the log's order is the engine's

    def floor(self) -> int:
        """The oldest cursor the log can bring to its head."""
        kept = self.log[0][0] - 1 if self.log else self.seq
        return max(self.gap, kept)

    def follows(self, cursor: P.CacheCursor | None) -> bool:
        return cursor is not None and cursor.epoch == self.epoch and self.floor() <= cursor.seq <= self.seq

    def pull(self, engine, snapshot_unless: P.CacheCursor | None) -> list[bytes] | None:
        """On the engine thread: its queued events into the log; the cache's hashes now if ``snapshot_unless``
        (the consumer's cursor) cannot be followed after them, else None."""
        for ev in engine.drain_cache_events():
            self.seq += 1
            self.log.append((self.seq, ev.kind, ev.hashes))
        if engine.events_dropped != self._dropped:
            self._dropped = engine.events_dropped
            self.gap = self.seq  # what came before the drained events is lost: everyone resyncs
        return None if self.follows(snapshot_unless) else engine.cached_hashes()

    async def report(self, cursor: P.CacheCursor | None) -> P.ModelCache:
        """The change since ``cursor`` (None: a new consumer), drained from the engine first."""
        async with self._lock:
            snap = await asyncio.wait_for(self.worker.call(lambda e: self.pull(e, cursor)), PULL_TIMEOUT_S)
            head = P.CacheCursor(self.epoch, self.seq)
            base = dict(block_size=self.block_size, extra=self.extra, enabled=self.enabled, cursor=head)
            if snap is not None:
                return P.ModelCache(**base, stored=snap, resync=True)
            return P.ModelCache(**base, **self.changes(cursor.seq))

    def changes(self, after: int) -> dict:
        """The net change of the events numbered after ``after``: stored, removed (each hash in one at most),
        cleared (forget everything first)."""
        state: dict[bytes, bool] = {}
        cleared = False
        for seq, kind, hashes in self.log:
            if seq <= after:
                continue
            if kind == "cleared":
                cleared = True
                state.clear()
                continue
            present = kind == "stored"
            for h in hashes:
                state[h] = present
        return {"stored": [h for h, v in state.items() if v],
                "removed": [] if cleared else [h for h, v in state.items() if not v], "cleared": cleared}
