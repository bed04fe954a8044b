"""Stop strings over a text stream: emit text as soon as it cannot be the start of a stop string
(the rule: compute/engine/stops.py)."""

from __future__ import annotations

from compute.engine.stops import visible_end


class StopMatcher:
    __slots__ = ("stops", "held")

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was hit; text after it is dropped)."""
        if not self.stops:
            return delta, False
        buf = self.held + delta
        end, hit = visible_end(buf, self.stops)
        self.held = "" if hit else buf[end:]
        return buf[:end], hit is not None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
