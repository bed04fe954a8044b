"""Retry with exponential backoff, a throttler that backs an actuator off after repeated failures,
and the restart backoff of a supervised process.

Three scales, as in kopf and the kubelet:
- `retry(fn, ...)` retries one API call a few times in place (a 500, a 409, a dropped
  connection), sleeping `Backoff.delay(attempt)` in between; it re-raises when the
  attempts run out or the error is not worth retrying.
- `Throttler` sits in the control loop: after a failed tick it says how long to leave
  the actuator alone (growing with consecutive failures), and it keeps the failure
  count and the last error so `pdserve status` can report them. The loop never raises.
- `RestartBackoff` is the kubelet's CrashLoopBackOff for one supervised process (a local
  node's slot): each exit on its own delays the next start (1 s, 2 s, 4 s ... capped); a
  start that stays ready for `reset_after_s` forgets the crash count.

Nothing here sleeps on its own clock: `sleep` and `now` are passed in, so tests run
without waiting.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Backoff:
    """delay(n) = min(max_s, base_s * factor**n), scaled by up to ±jitter."""

    base_s: float = 0.2  # first delay
    factor: float = 2.0  # growth per consecutive failure
    max_s: float = 30.0  # cap
    jitter: float = 0.0  # fraction of random spread (0 = deterministic, for tests)

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.factor < 1 or self.max_s < self.base_s or not 0 <= self.jitter < 1:
            raise ValueError(f"invalid backoff {self}: need base_s >= 0, factor >= 1, max_s >= base_s, 0 <= jitter < 1")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th consecutive failure (0-based)."""
        d = min(self.max_s, self.base_s * self.factor ** min(attempt, 64))
        if self.jitter:
            d *= 1 + random.uniform(-self.jitter, self.jitter)
        return d


def retry(fn: Callable[[], T], *, attempts: int, backoff: Backoff, retryable: Callable[[BaseException], bool],
          sleep: Callable[[float], None] = time.sleep) -> T:  # fmt: skip
    """fn(), retried up to `attempts` times in all while `retryable(error)`; the last error is re-raised."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if attempt + 1 >= attempts or not retryable(e):
                raise
            sleep(backoff.delay(attempt))
    raise AssertionError("unreachable: attempts >= 1")


@dataclass(slots=True)
class Throttler:
    """Backs off a failing actuator: after n consecutive failures, no action for backoff.delay(n-1) seconds."""

    backoff: Backoff
    failures: int = 0  # consecutive failed ticks
    until: float = 0.0  # no action before this time (loop clock)
    last_error: str = ""  # the latest failure, in words; "" after a success
    report_after: int = 3  # failures before the loop reports "repeated failures" loudly

    def ready(self, now: float) -> bool:
        return now >= self.until

    def success(self) -> None:
        self.failures, self.until, self.last_error = 0, 0.0, ""

    def failure(self, now: float, error: BaseException | str, delay: float | None = None) -> float:
        """Record one failure; returns the seconds until the next try (`delay` overrides the backoff)."""
        wait = self.backoff.delay(self.failures) if delay is None else delay
        self.failures += 1
        self.until = now + wait
        self.last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return wait

    @property
    def repeated(self) -> bool:
        return self.failures >= self.report_after


@dataclass(slots=True)
class RestartBackoff(Throttler):
    """When may a supervised process that exited on its own start again (CrashLoopBackOff).

    failure(now, why) on each exit (inherited): the next start waits backoff.delay(n - 1) after
    n consecutive exits; ready(now): may it start now; started(): count a restart; healthy(
    ready_since, now): a start that has stayed ready for reset_after_s forgets the crashes.
    """

    reset_after_s: float = 60.0  # ready this long after a restart: the crash loop is over
    restarts: int = 0  # restarts in all (never reset), for `pdserve status`

    def __post_init__(self) -> None:
        if self.reset_after_s <= 0:
            raise ValueError(f"reset_after_s must be > 0, not {self.reset_after_s}")

    def started(self) -> None:
        self.restarts += 1

    def healthy(self, ready_since: float, now: float) -> bool:
        """True (and the crash count forgotten) once the process has been ready for reset_after_s."""
        if self.failures and now - ready_since >= self.reset_after_s:
            self.success()
        return self.failures == 0

    def waiting(self, now: float) -> float:
        """Seconds left before the next start may happen (0: now)."""
        return max(0.0, self.until - now)
