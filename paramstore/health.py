"""Which storage locations answer, as this process has seen them: a location whose call failed (unreachable, timed
out: a partition) is asked last for ``SUSPECT_S``, by the catalog for replicated objects (``catalog.first_valid``)
and by the reader for fragments (``reader.py``). The memory is per process and per location URL; a location is
trusted again after ``SUSPECT_S``, or sooner where no other answers."""

from __future__ import annotations

import time

from .locations import Location

SUSPECT_S = 30.0  # a location that failed a call is asked last for this long (by_health)
_failed_at: dict[str, float] = {}  # location url -> monotonic time of its last failed call, in this process


def mark_failed(loc: Location) -> None:
    """``loc`` failed a call (unreachable, timed out): readers ask it last for ``SUSPECT_S``."""
    _failed_at[loc.url] = time.monotonic()


def suspect(loc: Location) -> bool:
    return time.monotonic() - _failed_at.get(loc.url, -2 * SUSPECT_S) < SUSPECT_S


def by_health(locations: list[Location]) -> list[Location]:
    """``locations`` in their order, those that failed in the last ``SUSPECT_S`` moved to the end."""
    return sorted(locations, key=suspect)
