"""Stop strings over a text stream: emit text as soon as it cannot be the start of a stop string."""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("stops", "held", "hold")

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was hit; text after it is dropped)."""
        if not self.stops:
            return delta, False
        buf = self.held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self.hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
