"""Popularity of (model, shard) pairs: exponentially decayed access counts.

Each access adds its weight (1 by default) to a score that halves every
``half_life_s`` seconds, so a score reads as "accesses in about the last
half-life, recent ones weighing more". A score is stored lazily as
``(value, as_of)``; its value at ``now`` is ``value * 2 ** (-(now - as_of) / h)``.
``record`` decays then adds (O(1)); ``rank`` decays every entry to one instant
and sorts. The autoscaler reads ``rank`` / ``rank_models`` to decide what to
pre-stage into node caches.

Persistence: ``save(path)`` writes JSON
``{"format", "half_life_s", "entries": [[model, shard, value, as_of], ...]}`` to a
temp file in the same directory and ``os.replace``s it into place (a reader sees
the old file or the new one); ``PopularityTracker.load(path)`` reads it back.
Times are wall clock (``time.time``) by default, so saved scores keep decaying
across a restart. Entries decayed below ``min_score`` are dropped. Thread-safe.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import InvalidRequest

_FORMAT = "pdserve-popularity/1"
_PRUNE_EVERY = 4096  # records between sweeps of decayed-out entries


@dataclass(slots=True)
class PopularityConfig:
    """Decay and bookkeeping of a popularity tracker."""

    half_life_s: float = 600.0  # a score halves after this many seconds without access
    clock: Callable[[], float] = time.time  # wall time, so saved scores decay across restarts; fake in tests
    min_score: float = 1e-3  # entries whose score decays below this are forgotten

    def __post_init__(self) -> None:
        h = self.half_life_s
        if not (isinstance(h, (int, float)) and math.isfinite(h) and h > 0):
            raise InvalidRequest(f"half_life_s must be a finite number > 0, got {self.half_life_s!r}")
        if not (isinstance(self.min_score, (int, float)) and self.min_score >= 0):
            raise InvalidRequest(f"min_score must be >= 0, got {self.min_score!r}")
        if not callable(self.clock):
            raise InvalidRequest("clock must be callable")


class PopularityTracker:
    """Exponentially decayed access scores per (model, shard), ranked on demand."""

    def __init__(self, config: PopularityConfig | None = None):
        self.config = config or PopularityConfig()
        self._scores: dict[tuple[str, str], list[float]] = {}  # (model, shard) -> [value, as_of]
        self._lock = threading.Lock()
        self._since_prune = 0

    def record(self, model: str, shard: str, now: float | None = None, weight: float = 1.0) -> float:
        """Count one access of ``shard`` of ``model`` (``weight`` accesses); return its new score."""
        for what, v in (("model", model), ("shard", shard)):
            if not isinstance(v, str) or not v:
                raise InvalidRequest(f"{what} must be a non-empty string, got {v!r}")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise InvalidRequest(f"weight must be a finite number >= 0, got {weight!r}")
        now = self._now(now)
        with self._lock:
            entry = self._scores.get((model, shard))
            if entry is None:
                entry = self._scores[(model, shard)] = [0.0, now]
            entry[0] = self._decayed(entry, now) + weight
            entry[1] = max(entry[1], now)
            self._since_prune += 1
            if self._since_prune >= _PRUNE_EVERY:
                self._prune(now)
            return entry[0]

    def score(self, model: str, shard: str, now: float | None = None) -> float:
        """The decayed score of one (model, shard) at ``now``; 0 if never seen."""
        now = self._now(now)
        with self._lock:
            entry = self._scores.get((model, shard))
            return self._decayed(entry, now) if entry else 0.0

    def rank(self, n: int, now: float | None = None) -> list[tuple[str, str, float]]:
        """The ``n`` most popular (model, shard, score), highest first (ties by name)."""
        now = self._now(now)
        with self._lock:
            self._prune(now)
            rows = [(m, s, self._decayed(e, now)) for (m, s), e in self._scores.items()]
        rows.sort(key=lambda r: (-r[2], r[0], r[1]))
        return rows[: max(n, 0)]

    def rank_models(self, n: int, now: float | None = None) -> list[tuple[str, float]]:
        """The ``n`` most popular models by the sum of their shards' scores, highest first."""
        now = self._now(now)
        totals: dict[str, float] = {}
        with self._lock:
            self._prune(now)
            for (m, _), e in self._scores.items():
                totals[m] = totals.get(m, 0.0) + self._decayed(e, now)
        rows = sorted(totals.items(), key=lambda r: (-r[1], r[0]))
        return rows[: max(n, 0)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._scores)

    # --- persistence ---
    def save(self, path: str | os.PathLike) -> None:
        """Write all live entries to ``path`` atomically (temp file in the same directory, then rename)."""
        now = self._now(None)
        with self._lock:
            self._prune(now)
            entries = [[m, s, e[0], e[1]] for (m, s), e in sorted(self._scores.items())]
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        doc = {"format": _FORMAT, "half_life_s": self.config.half_life_s, "entries": entries}
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, config: PopularityConfig | None = None) -> PopularityTracker:
        """A tracker with the entries saved at ``path`` (its half-life unless ``config`` is given).
        A missing file raises FileNotFoundError; a malformed one InvalidRequest."""
        with open(path) as f:
            try:
                doc = json.load(f)
            except ValueError as e:
                raise InvalidRequest(f"popularity file {path}: not JSON ({e})") from e
        try:
            if doc["format"] != _FORMAT:
                raise InvalidRequest(f"popularity file {path}: unknown format {doc['format']!r}")
            tracker = cls(config or PopularityConfig(half_life_s=float(doc["half_life_s"])))
            for m, s, value, as_of in doc["entries"]:
                tracker._scores[(str(m), str(s))] = [float(value), float(as_of)]
        except InvalidRequest:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"popularity file {path}: malformed ({e!r})") from e
        return tracker

    # --- internals (callers hold self._lock where state is touched) ---
    def _now(self, now: float | None) -> float:
        return self.config.clock() if now is None else float(now)

    def _decayed(self, entry: list[float], now: float) -> float:
        dt = max(0.0, now - entry[1])  # a clock stepping back never raises a score
        return entry[0] * 2.0 ** (-dt / self.config.half_life_s)

    def _prune(self, now: float) -> None:
        self._since_prune = 0
        floor = self.config.min_score
        dead = [key for key, e in self._scores.items() if self._decayed(e, now) < floor]
        for key in dead:
            del self._scores[key]
