"""Admission control: at most `max_running` requests in flight, `max_queue` waiting, each with a deadline.

A request beyond the queue bound is refused at once; one that waits past its
deadline is refused then. Both become 429 with Retry-After at the API. Queue
depth and waiting time are exported: they are the autoscaler's input.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from prometheus_client import Gauge, Histogram

QUEUE_DEPTH = Gauge("pdserve_gateway_queue_depth", "Requests waiting for admission")
RUNNING = Gauge("pdserve_gateway_running", "Requests admitted and in flight")
QUEUE_WAIT = Histogram("pdserve_gateway_queue_wait_seconds", "Time waiting for admission",
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))  # fmt: skip


WAIT_WINDOW_S = 60.0  # queue-wait statistics cover this much recent time


class Overloaded(Exception):
    """The gateway cannot take this request now; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    def __init__(self, max_running: int, max_queue: int, timeout_s: float):
        self.max_running, self.max_queue, self.timeout_s = max_running, max_queue, timeout_s
        self._sem = asyncio.Semaphore(max_running)
        self.waiting = 0
        self.running = 0
        self._waits: list[tuple[float, float]] = []  # (when, wait s) of the last minute: /load, autoscaler

    @asynccontextmanager
    async def slot(self):
        t0 = time.monotonic()
        if self._sem.locked():  # no free slot: wait in the bounded queue, until the deadline
            if self.waiting >= self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} waiting)", retry_after=1.0)
            self.waiting += 1
            QUEUE_DEPTH.set(self.waiting)
            try:
                await asyncio.wait_for(self._sem.acquire(), self.timeout_s)
            except asyncio.TimeoutError:
                raise Overloaded(f"no capacity within {self.timeout_s:g} s",
                                 retry_after=max(1.0, self.timeout_s / 4)) from None  # fmt: skip
            finally:
                self.waiting -= 1
                QUEUE_DEPTH.set(self.waiting)
        else:
            await self._sem.acquire()  # free right now: never counted as waiting
        waited = time.monotonic() - t0
        QUEUE_WAIT.observe(waited)
        self._waits = [w for w in self._waits[-1023:] if w[0] > t0 - WAIT_WINDOW_S] + [(t0, waited)]
        self.running += 1
        RUNNING.set(self.running)
        try:
            yield waited
        finally:
            self.running -= 1
            RUNNING.set(self.running)
            self._sem.release()

    def wait_p99(self) -> float:
        """p99 of the waits of the last minute (0 when idle: an old burst must not veto scale-down)."""
        now = time.monotonic()
        w = sorted(x for t, x in self._waits if t > now - WAIT_WINDOW_S)
        if not w:
            return 0.0
        return w[min(len(w) - 1, int(0.99 * len(w)))]
