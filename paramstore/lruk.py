"""LRU-K eviction order (O'Neil et al.), as a pure policy shared by the cache tiers."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping

from .errors import InvalidRequest


class LruK:
    """LRU-K eviction order. Pure: no I/O and no clock of its own (callers pass times).

    Keys are ordered by their K-th most recent access, oldest first; keys with fewer
    than K accesses have infinite backward K-distance and come before all others.
    Ties (and the order among keys with < K accesses) go by least recent access.
    """

    __slots__ = ("k", "_hist")

    def __init__(self, k: int = 2, history: Mapping[str, Iterable[float]] | None = None):
        if k < 1:
            raise InvalidRequest(f"LRU-K needs k >= 1, got {k}")
        self.k = k
        self._hist: dict[str, deque[float]] = {}
        for key, times in (history or {}).items():
            self._hist[key] = deque(sorted(times), maxlen=k)

    def touch(self, key: str, now: float) -> None:
        """Record one access of ``key`` at time ``now`` (a clock going backwards is clamped)."""
        h = self._hist.setdefault(key, deque(maxlen=self.k))
        h.append(max(now, h[-1]) if h else now)

    def remove(self, key: str) -> None:
        """Forget ``key`` and its history."""
        self._hist.pop(key, None)

    def history(self, key: str) -> list[float]:
        """The up to K most recent access times of ``key``, oldest first."""
        return list(self._hist.get(key, ()))

    def order(self, keys: Iterable[str]) -> list[str]:
        """``keys`` in eviction order, first victim first."""
        return sorted(keys, key=self._rank)

    def victims(self, sizes: Mapping[str, int], budget: int, protect: Iterable[str] = ()) -> list[str]:
        """Keys to evict, in order, so that the sizes of the rest fit ``budget``; never a protected key."""
        keep = set(protect)
        total = sum(sizes.values())
        out = []
        for key in self.order(k for k in sizes if k not in keep):
            if total <= budget:
                break
            out.append(key)
            total -= sizes[key]
        return out

    def _rank(self, key: str) -> tuple[float, float, str]:
        h = self._hist.get(key)
        if not h:
            return (-math.inf, -math.inf, key)
        return (h[0] if len(h) == self.k else -math.inf, h[-1], key)
