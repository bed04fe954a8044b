"""What the gateway observes of each model's traffic: the autoscaler's per-model input.

Lifecycle of a request's marks, per model: ``arrived`` (counted, the model no longer idle) ->
``admitting`` / ``admitted`` (waiting for an admission slot, then running; the wait sampled) ->
``first_token`` (TTFT sampled) -> ``finished`` (TPOT sampled: (end - first token) / (tokens - 1),
for requests of 2 tokens or more; the model idle from now if nothing else runs). Held requests
(no node holds the model yet) are counted by ``gateway.routing.activator``.

Samples are (time, value) pairs kept for ``WINDOW_S`` (at most ``MAX_SAMPLES`` per series):
p99s cover the last minute, and 0.0 with no sample (an old burst must not veto scale-down).
Arrival rates (the autoscaler's demand signal, Dynamo's SLA-planner input) cover only the last
``RATE_WINDOW_S``, fast to rise: each is the larger of the rate over the whole window and over its
last ``FAST_WINDOW_S`` (a step up in arrivals shows in full within a second; a gap shows only once
the whole window has passed, so one quiet second does not read as no demand): ``requests_per_s``, ``prompt_tokens_per_s`` (the prompts that arrived) and
``output_tokens_per_s`` (each arrival's expected output: its max_tokens, capped by the mean
tokens of the requests finished in the last minute, since most stop at EOS before it). A
short window so a burst shows within a tick or two of the control loop (0.5 s ticks locally).
``recent_requests`` is the number of arrivals in the window: the rates of one or two requests are
noise, and the policy caps the demand by it.
The clock is passed in (tests step a fake one). The event loop marks; ``snapshot`` may be called
from another thread (`pdserve up`'s control loop): one lock covers both.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
MAX_SAMPLES = 2048
RATE_WINDOW_S = 2.0  # arrivals counted over this long for the rates: 4 ticks of 0.5 s, enough arrivals at
#   a few requests/s not to jitter
FAST_WINDOW_S = 1.0  # ... and over this last part of it: a step up is seen in full after 1 s (2 ticks)


def _p99(samples: deque, now: float) -> float:
    while samples and samples[0][0] < now - WINDOW_S:
        samples.popleft()
    if not samples:
        return 0.0
    w = sorted(v for _, v in samples)
    return w[min(len(w) - 1, int(0.99 * len(w)))]


@dataclass(slots=True)
class ModelTraffic:
    """One model's counters and recent samples."""

    since: float  # wall time the gateway started watching this model (idle_s when no request yet)
    requests: int = 0  # arrived since start
    admitting: int = 0  # waiting for an admission slot
    running: int = 0  # admitted, in flight
    last_request_t: float | None = None  # wall time of the last arrival or finish
    waits: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    ttfts: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    tpots: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    arrivals: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # (t, prompt tokens, max_tokens)
    outputs: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # (t, tokens streamed), finished


class Traffic:
    """Per-model ``ModelTraffic``; `clock` gives monotonic seconds, `wall` unix time."""

    def __init__(self, clock=time.monotonic, wall=time.time):
        self.clock, self.wall = clock, wall
        self.started = wall()
        self.models: dict[str, ModelTraffic] = {}
        self._lock = threading.Lock()

    def of(self, model: str) -> ModelTraffic:
        m = self.models.get(model)
        if m is None:
            m = self.models.setdefault(model, ModelTraffic(self.started))
        return m

    def arrived(self, model: str, prompt_tokens: int = 0, max_tokens: int = 0) -> None:
        with self._lock:
            m = self.of(model)
            m.requests += 1
            m.last_request_t = self.wall()
            m.arrivals.append((self.clock(), int(prompt_tokens), int(max_tokens)))

    def admitting(self, model: str, delta: int) -> None:
        with self._lock:
            self.of(model).admitting += delta

    def admitted(self, model: str, waited_s: float) -> None:
        with self._lock:
            m = self.of(model)
            m.running += 1
            m.waits.append((self.clock(), waited_s))

    def first_token(self, model: str, ttft_s: float) -> None:
        with self._lock:
            self.of(model).ttfts.append((self.clock(), ttft_s))

    def finished(self, model: str, tokens: int, first_t: float | None, end_t: float) -> None:
        """An admitted request ended (any way); `first_t`/`end_t` monotonic, `tokens` streamed."""
        with self._lock:
            m = self.of(model)
            m.running -= 1
            m.last_request_t = self.wall()
            if first_t is not None:
                m.outputs.append((self.clock(), int(tokens)))
            if first_t is not None and tokens > 1:
                m.tpots.append((self.clock(), (end_t - first_t) / (tokens - 1)))

    def snapshot(self, model: str, held: int = 0) -> dict:
        """The per-model fields of /internal/status (gateway.routes.internal)."""
        with self._lock:
            m, now = self.of(model), self.clock()
            last = m.last_request_t
            idle = 0.0 if m.running or held else self.wall() - (last if last is not None else m.since)
            return {"queue_depth": m.admitting + held, "held": held, "running": m.running,
                    "queue_wait_p99_s": _p99(m.waits, now), "ttft_p99_s": _p99(m.ttfts, now),
                    "tpot_p99_s": _p99(m.tpots, now), "requests": m.requests, "last_request_t": last,
                    "idle_s": max(0.0, idle), **_rates(m, now)}  # fmt: skip


def _rates(m: ModelTraffic, now: float) -> dict:
    """requests_per_s, prompt_tokens_per_s, output_tokens_per_s over the last RATE_WINDOW_S."""
    while m.arrivals and m.arrivals[0][0] <= now - RATE_WINDOW_S:
        m.arrivals.popleft()
    while m.outputs and m.outputs[0][0] < now - WINDOW_S:
        m.outputs.popleft()
    mean_out = sum(n for _, n in m.outputs) / len(m.outputs) if m.outputs else None

    def over(window_s: float) -> tuple[float, float, float]:
        recent = [a for a in m.arrivals if a[0] > now - window_s]
        out = sum(mx if mean_out is None else min(mx or mean_out, mean_out) for _, _, mx in recent)
        return len(recent) / window_s, sum(p for _, p, _ in recent) / window_s, out / window_s

    rates = [max(a, b) for a, b in zip(over(RATE_WINDOW_S), over(FAST_WINDOW_S), strict=True)]
    out = dict(zip(("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s"), rates, strict=True))
    return out | {"recent_requests": len(m.arrivals)}  # the count behind them: a rate of one request is noise
