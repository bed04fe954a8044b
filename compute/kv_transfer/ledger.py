"""Bookkeeping of holds (sender) and transfers (receiver): states, deadlines, history.

Pure data under a lock, no I/O: the backends and ``base`` decide what to do on
a transition. States are ``TransferState`` values (strings). Terminal entries
leave the live set at once and stay readable in a bounded history so a late
``poll`` still answers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

_HISTORY = 4096  # terminal entries kept for late polls
_TERMINAL = ("done", "failed")


@dataclass(slots=True)
class Hold:
    """One offered request on the sender."""

    request_id: str
    block_ids: list[int]  # every block the engine gave (released together)
    n: int  # blocks actually sent: block_ids[:n]
    num_tokens: int
    deadline: float  # monotonic: release if no receiver by then
    expires_at: float  # the same deadline on the wall clock (travels in the handle)
    state: str = "bootstrapping"
    reason: str = ""
    wire_nbytes: int = 0
    cut: bool = False  # abort asked while streaming: stop the stream
    ending: str = ""  # release/abort asked while streaming: the reason to end with
    began: float = 0.0  # monotonic time the stream began
    extra: dict = field(default_factory=dict)  # backend data (secret, staging slots, ...)

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL


class SenderLedger:
    """``hold_s``: wait for a receiver this long; ``stream_s``: a begun stream that has
    not ended itself after this long is ended anyway (a safety net: streams have
    their own, shorter timeouts)."""

    def __init__(self, hold_s: float, stream_s: float, clock=time.monotonic):
        self.hold_s, self.stream_s, self._clock = hold_s, stream_s, clock
        self._lock = threading.Lock()
        self._live: dict[str, Hold] = {}
        self._past: OrderedDict[str, Hold] = OrderedDict()

    def add(self, request_id: str, block_ids: list[int], n: int, num_tokens: int) -> Hold:
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already offered")
            h = Hold(request_id, block_ids, n, num_tokens, self._clock() + self.hold_s, time.time() + self.hold_s)
            self._past.pop(request_id, None)
            self._live[request_id] = h
            return h

    def get(self, request_id: str) -> Hold | None:
        with self._lock:
            return self._live.get(request_id) or self._past.get(request_id)

    def state(self, request_id: str) -> str:
        h = self.get(request_id)
        if h is None:
            raise KeyError(request_id)
        return h.state

    def begin(self, request_id: str) -> tuple[Hold | None, str]:
        """BOOTSTRAPPING -> TRANSFERRING for a stream; ``(hold, "")`` or ``(None, reason)``."""
        with self._lock:
            h = self._live.get(request_id)
            if h is None:
                return None, ("unknown" if request_id not in self._past else self._past[request_id].reason or "done")
            if h.state != "bootstrapping":
                return None, "busy"
            if self._clock() > h.deadline:
                return None, "expired"
            h.state, h.began = "transferring", self._clock()
            return h, ""

    def finish(self, request_id: str, state: str, reason: str = "") -> Hold | None:
        """End a live hold; returns it if this call ended it (first call wins)."""
        with self._lock:
            h = self._live.pop(request_id, None)
            if h is None:
                return None
            h.state, h.reason = state, reason if state == "failed" else ""
            self._past[request_id] = h
            while len(self._past) > _HISTORY:
                self._past.popitem(last=False)
            return h

    def expired(self) -> list[str]:
        """Holds waiting for a receiver past their deadline, and streams past ``stream_s``."""
        now = self._clock()
        with self._lock:
            return [r for r, h in self._live.items()
                    if (now > h.deadline if h.state == "bootstrapping" else now > h.began + self.stream_s)]  # fmt: skip

    def held(self) -> int:
        with self._lock:
            return len(self._live)

    def held_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)


@dataclass(slots=True)
class Transfer:
    """One receive on the decode side."""

    id: str
    request_id: str
    dst: list[int]  # destination blocks, in position order
    started: float  # monotonic
    deadline: float  # monotonic: FAILED('timeout') after this
    nbytes: int  # uncompressed KV bytes
    wire_nbytes: int  # bytes on the transport
    first: int = 0  # the handle's blocks [0, first) the receiver already held: not moved
    state: str = "bootstrapping"
    reason: str = ""
    ended: float | None = None
    extra: dict = field(default_factory=dict)  # backend data (socket, xfer handle, ...)

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def overdue(self) -> bool:
        return time.monotonic() > self.deadline

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)


class ReceiverLedger:
    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live: dict[str, Transfer] = {}
        self._past: OrderedDict[str, Transfer] = OrderedDict()

    def add(self, request_id: str, dst: list[int], timeout_s: float, nbytes: int, wire_nbytes: int) -> Transfer:
        now = time.monotonic()
        with self._lock:
            t = Transfer(f"{request_id}#{next(self._ids)}", request_id, dst, now, now + timeout_s, nbytes, wire_nbytes)
            self._live[t.id] = t
            return t

    def get(self, transfer_id: str) -> Transfer | None:
        with self._lock:
            return self._live.get(transfer_id) or self._past.get(transfer_id)

    def moving(self, t: Transfer) -> bool:
        """BOOTSTRAPPING -> TRANSFERRING unless already terminal."""
        with self._lock:
            if t.terminal:
                return False
            t.state = "transferring"
            return True

    def finish(self, t: Transfer, state: str, reason: str = "") -> bool:
        with self._lock:
            if t.terminal:
                return False
            t.state, t.reason, t.ended = state, reason if state == "failed" else "", time.monotonic()
            self._live.pop(t.id, None)
            self._past[t.id] = t
            while len(self._past) > _HISTORY:
                self._past.popitem(last=False)
            return True

    def active(self) -> int:
        with self._lock:
            return len(self._live)

    def active_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)
