"""Admission control: at most `max_running` requests in flight, at most `max_queue` waiting, and no
request waits longer than `timeout_s` before it starts.

Lifecycle of a request here:
 1. arrives with a free slot (and nobody waiting): starts at once, never counted as waiting;
 2. no free slot: refused at once (429) when the queue is full (``max_queue`` bounds memory however
    large the overload), or when the queue ahead of it cannot drain in time:
    predicted wait = position / drain rate > timeout_s (position 1-based, rate as below);
 3. otherwise waits in its caller's queue (``CALLER``: one per API key; everyone is one caller without keys),
    first in first out within it; a finishing request hands its slot straight to the head of the next
    caller's queue in turn (round robin), so a caller that fans out many requests (n, best_of, a list of
    prompts) or floods the gateway takes turns with the others instead of making them wait behind it;
 4. still waiting at its deadline (arrival + timeout_s): refused then (429);
 5. once started it is never refused: it runs to completion and releases its slot.

Drain rate r (starts per second): requests admitted out of the queue per second of time during
which some request was waiting, over the last DRAIN_WINDOW_S (at most DRAIN_SAMPLES samples):
    r = hand-offs / (busy seconds between them + the open stretch since the last one).
A queue that emptied without draining (every waiter timed out or left) counts as busy time with
no hand-off, so a stalled service drives r down. With no hand-off in the window r is unknown:
then no early refusal (step 2), only the deadline (step 4).

Retry-After (whole seconds) = clamp(ceil(waiting / r), 1, ceil(timeout_s)): the time for the
queue now waiting to drain at r, after which a retry no longer queues behind it. Never more than
timeout_s (by then every request now waiting has started or been refused); timeout_s when r is
unknown. ``AdmissionQueue`` holds these decisions as plain data with the time passed in (tests
step it with a fake clock); ``Admission`` puts asyncio waiting and the deadline timers around it.
Queue depth, waiting time and drain rate are exported: they are the autoscaler's input.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import Gauge, Histogram

QUEUE_DEPTH = Gauge("pdserve_gateway_queue_depth", "Requests waiting for admission")
RUNNING = Gauge("pdserve_gateway_running", "Requests admitted and in flight")
QUEUE_WAIT = Histogram("pdserve_gateway_queue_wait_seconds", "Time waiting for admission",
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))  # fmt: skip

WAIT_WINDOW_S = 60.0  # queue-wait statistics cover this much recent time
DRAIN_WINDOW_S = 30.0  # drain-rate samples older than this are dropped
DRAIN_SAMPLES = 512  # and at most this many are kept (bounded memory)
CALLER: ContextVar[str] = ContextVar("pdserve_caller", default="")  # whose request: set by the API key check


class Overloaded(Exception):
    """The gateway cannot start this request in time; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place: started at once, or waiting until `deadline` (monotonic seconds)."""

    arrived: float
    deadline: float
    caller: str = ""
    started: bool = False
    wake: asyncio.Future | None = None  # set by ``Admission`` for a waiting ticket


class AdmissionQueue:
    """The decisions of admission, as plain data: no asyncio, no clock of its own (``now`` is passed)."""

    def __init__(self, max_running: int, max_queue: int, timeout_s: float):
        if max_running < 1 or max_queue < 1 or timeout_s <= 0:
            raise ValueError("max_running >= 1, max_queue >= 1, timeout_s > 0")
        self.max_running, self.max_queue, self.timeout_s = max_running, max_queue, timeout_s
        self.running = 0
        self.queues: OrderedDict[str, deque[Ticket]] = OrderedDict()  # caller -> its waiting tickets; whose turn first
        self._waiting = 0
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=DRAIN_SAMPLES)  # (when, hand-offs, busy s)
        self._busy_since: float | None = None  # start of the open stretch with somebody waiting

    @property
    def waiting(self) -> int:
        return self._waiting

    def holds(self, t: Ticket) -> bool:
        """``t`` is waiting here."""
        return t in self.queues.get(t.caller, ())

    def position(self, caller: str) -> int:
        """Where a new ticket of ``caller`` would start, 1-based, under round robin: after its own waiting
        ones, each turn also starting one of every other caller still waiting then (bounded by everyone)."""
        own = len(self.queues.get(caller, ()))
        turns = [min(len(q), own + 1) for c, q in self.queues.items() if c != caller]
        return own + 1 + sum(turns)

    def offer(self, now: float, caller: str = "") -> Ticket:
        """A request arrives: a started ticket, a waiting one, or Overloaded (step 1 or 2)."""
        t = Ticket(now, now + self.timeout_s, caller)
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            t.started = True
            return t
        if self._waiting >= self.max_queue:
            raise Overloaded(f"queue full ({self.max_queue} waiting)", self.retry_after(now))
        pos = self.position(caller)
        wait = self.predicted_wait(pos, now)
        if wait is not None and wait > self.timeout_s:
            raise Overloaded(f"cannot start within {self.timeout_s:g} s: {pos - 1} would start ahead of it, "
                             f"predicted wait {wait:.1f} s", self.retry_after(now))  # fmt: skip
        if not self._waiting:
            self._busy_since = now
        self.queues.setdefault(caller, deque()).append(t)
        self._waiting += 1
        return t

    def release(self, now: float) -> Ticket | None:
        """A started request finished: its slot goes to the head of the next caller's queue in turn (returned,
        now started); that caller goes to the back of the turn if it still has some waiting."""
        if self._waiting:
            caller, q = next(iter(self.queues.items()))
            t = q.popleft()
            if q:
                self.queues.move_to_end(caller)
            else:
                del self.queues[caller]
            self._waiting -= 1
            t.started = True
            self._sample(now, 1)
            return t
        assert self.running > 0, "release without a running request"
        self.running -= 1
        return None

    def withdraw(self, t: Ticket, now: float) -> None:
        """A waiting request leaves (its deadline passed, or its client went away)."""
        assert not t.started, "a started request is released, not withdrawn"
        q = self.queues[t.caller]
        q.remove(t)
        if not q:
            del self.queues[t.caller]
        self._waiting -= 1
        if not self._waiting:
            self._sample(now, 0)

    def expired(self, t: Ticket, now: float) -> Overloaded:
        """Step 4: withdraw `t` at its deadline -> the refusal to give its client."""
        self.withdraw(t, now)
        return Overloaded(f"no capacity within {self.timeout_s:g} s", self.retry_after(now))

    # --- drain rate ------------------------------------------------------------------------
    def _sample(self, now: float, handoffs: int) -> None:
        busy = now - self._busy_since if self._busy_since is not None else 0.0
        self._samples.append((now, handoffs, busy))
        self._busy_since = now if self._waiting else None

    def drain_rate(self, now: float) -> float | None:
        """Hand-offs per busy second over the window (see the module docstring); None when unknown."""
        while self._samples and self._samples[0][0] < now - DRAIN_WINDOW_S:
            self._samples.popleft()
        n = sum(s[1] for s in self._samples)
        if n == 0:
            return None
        busy = sum(s[2] for s in self._samples) + (now - self._busy_since if self._busy_since is not None else 0.0)
        return n / max(busy, 1e-3)

    def predicted_wait(self, position: int, now: float) -> float | None:
        """Seconds until the request at 1-based `position` in the queue starts: position / r."""
        r = self.drain_rate(now)
        return None if r is None else position / r

    def retry_after(self, now: float) -> int:
        cap = math.ceil(self.timeout_s)
        r = self.drain_rate(now)
        if r is None:
            return cap
        return max(1, min(cap, math.ceil(self._waiting / r)))


class Admission:
    """``AdmissionQueue`` for asyncio: ``async with admission.slot():`` waits (bounded) or raises Overloaded."""

    def __init__(self, max_running: int, max_queue: int, timeout_s: float, clock=time.monotonic):
        self.q = AdmissionQueue(max_running, max_queue, timeout_s)
        self.clock = clock
        self._waits: deque[tuple[float, float]] = deque(maxlen=1024)  # (when, wait s): /load, autoscaler

    waiting = property(lambda self: self.q.waiting)
    running = property(lambda self: self.q.running)

    def drain_rate(self) -> float | None:
        return self.q.drain_rate(self.clock())

    @asynccontextmanager
    async def slot(self, caller: str | None = None):
        """A slot for this request (``caller``: whose, default ``CALLER``'s value), waited for in turn."""
        t = self.q.offer(self.clock(), CALLER.get() if caller is None else caller)
        if not t.started:
            await self._wait(t)
        waited = self.clock() - t.arrived
        QUEUE_WAIT.observe(waited)
        self._waits.append((t.arrived, waited))
        RUNNING.set(self.q.running)
        try:
            yield waited
        finally:
            self._release()

    async def _wait(self, t: Ticket) -> None:
        loop = asyncio.get_running_loop()
        t.wake = loop.create_future()

        def expire():
            if not t.started and not t.wake.done():
                t.wake.set_exception(self.q.expired(t, self.clock()))
                QUEUE_DEPTH.set(self.q.waiting)

        timer = loop.call_later(max(0.0, t.deadline - self.clock()), expire)
        QUEUE_DEPTH.set(self.q.waiting)
        try:
            await t.wake  # a result: handed a slot; an exception: Overloaded at the deadline
        except asyncio.CancelledError:  # the client went away while waiting
            if t.started:
                self._release()  # handed a slot at the same moment: pass it on
            elif self.q.holds(t):
                self.q.withdraw(t, self.clock())
            raise
        finally:
            timer.cancel()
            QUEUE_DEPTH.set(self.q.waiting)

    def _release(self) -> None:
        nxt = self.q.release(self.clock())
        if nxt is not None and not nxt.wake.done():
            nxt.wake.set_result(None)
        # (done: its waiter was cancelled meanwhile; its handler sees `started` and passes the slot on)
        RUNNING.set(self.q.running)
        QUEUE_DEPTH.set(self.q.waiting)

    def wait_p99(self) -> float:
        """p99 of the waits of the last minute (0 when idle: an old burst must not veto scale-down)."""
        now = self.clock()
        w = sorted(x for t, x in self._waits if t > now - WAIT_WINDOW_S)
        if not w:
            return 0.0
        return w[min(len(w) - 1, int(0.99 * len(w)))]
