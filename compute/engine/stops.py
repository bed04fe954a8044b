"""Where the visible text ends: the one rule for stop strings and held-back markers.

Text arrives in deltas; a marker (a stop string, the opening of a tool call) may be split across two
of them. ``visible_end(buf, markers)`` says how much of ``buf`` may be shown now: up to the earliest
marker found (and which one: the text ends there), or else all but the longest end of ``buf`` that
begins some marker (held back until what follows says whether it completes one). Used by the node's
text stream (compute/engine/stream.py), the gateway's stop strings (gateway/api/stops.py) and the tool-call
parser (gateway/api/tools.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def visible_end(buf: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """-> (index where the visible text of ``buf`` ends now, the marker found there or None)."""
    hits = [(i, s) for s in markers if s and (i := buf.find(s)) >= 0]
    if hits:
        return min(hits)
    return len(buf) - held_back(buf, markers), None


def held_back(buf: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``buf`` that is a proper beginning of some marker."""
    longest = max((len(s) for s in markers), default=1) - 1
    for n in range(min(longest, len(buf)), 0, -1):
        tail = buf[-n:]
        if any(s.startswith(tail) for s in markers):
            return n
    return 0
