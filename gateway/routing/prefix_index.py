"""Which node holds which prefix blocks, per model: the gateway's index for routing by cache.

Two parts, both block hash -> nodes:

- precise: the nodes' own reports (POST /internal/cache, compute/node/cache_feed.py), folded per node and
  model: the blocks the node's prefix cache holds as of its last report (the registry's poll, every
  ``health_interval_s``);
- approximate: what this gateway sent where (``record``, at routing time): the prompt's full blocks on the
  node chosen, for ``ttl_s`` — the window until that node has computed them and a report says so (a
  report that removes a block removes its record too).

Lifecycle of a node in the index:

1. registered and routable: each poll asks for its cache from the cursor of its last report (none: a
   full snapshot, as for a new gateway, a node restarted or a model reloaded);
2. each report is folded (``apply``): resync or cleared -> its hashes of that model forgotten; then removed,
   then stored. A model not in the report (not ready there, draining, unloaded) leaves the index;
3. routed to: its request's blocks recorded (approximate) until the TTL;
4. removed, drained, or evicted by failed health checks: ``forget`` — nothing of it is matched again, its
   cursors dropped (back later, it starts from a snapshot).

Matching (``match``): the request's block hashes computed as the model's nodes compute them (the block size
and extra keys they reported, the request's ``cache_salt``: compute/engine/prefix_hash.py), then per node
the longest run from block 0 that it holds, precise or approximate, in tokens — capped as the node caps a
hit (at least ``MIN_COMPUTED`` prompt tokens left to compute). Hashes are SHA-256: the same in every process.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from compute.engine.prefix_hash import prompt_hashes
from compute.node import protocol as P

HOT_CHAINS = 256  # chains counted per model for pre-pull (the least asked dropped first)


@dataclass(slots=True)
class NodeCache:
    """One node's cache of one model, as its reports said."""

    cursor: P.CacheCursor
    block_size: int
    extra: tuple[str, ...]
    enabled: bool
    hashes: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class ModelIndex:
    """One model's blocks: who holds each (precise), who was sent each (approximate, until an expiry)."""

    holders: dict[bytes, set[str]] = field(default_factory=dict)
    sent: dict[bytes, dict[str, float]] = field(default_factory=dict)


@dataclass(slots=True)
class PrefixMatch:
    """A request's prefix against one model's nodes: per node its hit in tokens, and the hashes it was
    matched with (per node: nodes of another block size or extra keys hash otherwise)."""

    model: str
    hits: dict[str, int]
    hashes: dict[str, list[bytes]]

    def best(self) -> int:
        return max(self.hits.values(), default=0)


class PrefixIndex:
    def __init__(self, ttl_s: float = 10.0, clock=time.monotonic) -> None:
        """``ttl_s``: how long a routing decision counts as the node holding the request's blocks."""
        self.ttl_s, self.clock = ttl_s, clock
        self._nodes: dict[str, dict[str, NodeCache]] = {}  # url -> model -> its cache
        self._models: dict[str, ModelIndex] = {}
        self._expiry: deque[tuple[float, str, bytes, str]] = deque()  # (when, model, hash, url), oldest first
        self._hot: dict[str, dict[bytes, list]] = {}  # model -> a chain's last hash -> [times routed, its hashes]

    # --- the precise part: the nodes' reports ------------------------------------------------
    def cursors(self, url: str) -> dict[str, P.CacheCursor]:
        """Per model, where the next report of ``url`` starts."""
        return {m: c.cursor for m, c in self._nodes.get(url, {}).items()}

    def apply(self, url: str, report: P.CacheReport) -> None:
        """Fold one report of ``url`` (every model it serves ready; one it left out leaves the index)."""
        mine = self._nodes.setdefault(url, {})
        for model in [m for m in mine if m not in report.models]:
            self._drop(url, model)
        for model, mc in report.models.items():
            nc = mine.get(model)
            key = (mc.block_size, tuple(mc.extra), mc.enabled)
            if nc is None or mc.resync or mc.cleared or (nc.block_size, nc.extra, nc.enabled) != key:
                self._drop(url, model)
                nc = mine[model] = NodeCache(mc.cursor, mc.block_size, tuple(mc.extra), mc.enabled)
            idx = self._models.setdefault(model, ModelIndex())
            for h in mc.removed:
                nc.hashes.discard(h)
                _discard(idx.holders, h, url)
                _discard(idx.sent, h, url)
            for h in mc.stored:
                nc.hashes.add(h)
                idx.holders.setdefault(h, set()).add(url)
            nc.cursor = mc.cursor

    def forget(self, url: str) -> None:
        """``url`` left (removed, drained, evicted): none of its blocks is matched again."""
        for model in list(self._nodes.get(url, {})):
            self._drop(url, model)
        self._nodes.pop(url, None)
        for idx in self._models.values():
            for h in [h for h, who in idx.sent.items() if url in who]:
                _discard(idx.sent, h, url)

    def held(self, url: str, model: str) -> set[bytes]:
        """The hashes ``url`` reported holding for ``model`` (a test's reading)."""
        nc = self._nodes.get(url, {}).get(model)
        return set(nc.hashes) if nc is not None else set()

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def summary(self) -> dict[str, dict[str, int]]:
        """url -> model -> blocks it reported holding (the status page's; safe from another thread)."""
        return {url: {m: len(c.hashes) for m in list(caches) if (c := caches.get(m)) is not None}
                for url, caches in list(self._nodes.items())}  # fmt: skip

    def block_sizes(self, model: str) -> dict[str, int]:
        """url -> the block size its engine of ``model`` reported."""
        return {url: c[model].block_size for url, c in self._nodes.items() if model in c}

    # --- routing: match and record ------------------------------------------------------------
    def match(self, model: str, prompt: list[int], salt: str | None = None) -> PrefixMatch:
        """Per node of ``model`` with a prefix cache, the tokens of ``prompt`` its cache would give."""
        now = self.clock()
        self._expire(now)
        idx = self._models.get(model)
        hits: dict[str, int] = {}
        hashes: dict[str, list[bytes]] = {}
        by_key: dict[tuple, list[bytes]] = {}
        for url, caches in self._nodes.items():
            nc = caches.get(model)
            if nc is None or not nc.enabled:
                continue
            key = (nc.block_size, nc.extra)
            if key not in by_key:
                by_key[key] = prompt_hashes(prompt, nc.block_size, nc.extra, salt)  # as the node caps a hit
            hs = hashes[url] = by_key[key]
            hits[url] = _run(idx, hs, url, now) * nc.block_size if idx is not None else 0
        return PrefixMatch(model, hits, hashes)

    def record(self, match: PrefixMatch, url: str) -> None:
        """``url`` was sent the request ``match`` was made for: count its blocks as there for ``ttl_s``, and its
        chain among the model's hottest (``hottest``)."""
        hs = match.hashes.get(url)
        if not hs:
            return
        hot = self._hot.setdefault(match.model, {})
        entry = hot.pop(hs[-1], None) or [0, hs]
        entry[0] += 1
        hot[hs[-1]] = entry  # most recent last: a full table drops the least recent of the least asked
        if len(hot) > HOT_CHAINS:
            del hot[min(hot, key=lambda h: hot[h][0])]
        when = self.clock() + self.ttl_s
        idx = self._models.setdefault(match.model, ModelIndex())
        for h in hs:
            idx.sent.setdefault(h, {})[url] = when
            self._expiry.append((when, match.model, h, url))
        self._expire(self.clock())

    # --- pre-pull: the hottest chains and who holds them -----------------------------------------
    def hottest(self, model: str, n: int) -> list[list[bytes]]:
        """The ``n`` block-hash chains of ``model`` most often routed (a prompt's full blocks each)."""
        hot = self._hot.get(model, {})
        return [hs for _, hs in sorted(hot.values(), key=lambda e: -e[0])[:n]]

    def holder(self, model: str, hashes: list[bytes], exclude: str = "") -> tuple[str | None, int]:
        """The node whose report holds the longest run of ``hashes`` (not ``exclude``), and its length in blocks."""
        idx = self._models.get(model)
        if idx is None:
            return None, 0
        runs = [(_run(idx, hashes, url, float("inf")), url) for url in self._nodes if url != exclude]
        n, url = max(runs, default=(0, None))
        return (url, n) if n else (None, 0)

    def held_run(self, model: str, hashes: list[bytes], url: str) -> int:
        """How many of ``hashes``, from the first, ``url`` reported holding."""
        idx = self._models.get(model)
        return _run(idx, hashes, url, float("inf")) if idx is not None else 0

    # --- internals ------------------------------------------------------------------------------
    def _drop(self, url: str, model: str) -> None:
        nc = self._nodes.get(url, {}).pop(model, None)
        idx = self._models.get(model)
        if nc is None or idx is None:
            return
        for h in nc.hashes:
            _discard(idx.holders, h, url)

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            when, model, h, url = self._expiry.popleft()
            idx = self._models.get(model)
            who = idx.sent.get(h) if idx is not None else None
            if who is not None and who.get(url) == when:  # not recorded again since
                _discard(idx.sent, h, url)


def _run(idx: ModelIndex, hashes: list[bytes], url: str, now: float) -> int:
    """How many of ``hashes``, from the first, ``url`` holds (reported, or sent and not expired)."""
    n = 0
    for h in hashes:
        if url not in idx.holders.get(h, ()) and idx.sent.get(h, {}).get(url, 0.0) <= now:
            break
        n += 1
    return n


def _discard(table: dict, h: bytes, url: str) -> None:
    """``url`` out of ``table[h]`` (a set or a dict), and the entry gone when empty."""
    who = table.get(h)
    if who is None:
        return
    if isinstance(who, set):
        who.discard(url)
    else:
        who.pop(url, None)
    if not who:
        del table[h]
