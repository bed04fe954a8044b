"""ControlLoop: every tick, observe → decide → act; the policy stays a pure function.

The loop is key-generic: a key is whatever the observer and the actuator agree on — `(model,
role)` with the warm pool (autoscaler/pool.py); the policy sizes each key on its own.

One tick:
 1. observe   `actuator.current()` -> {key: [NodeInfo]}, then `observe()` -> {key: RoleLoad}
              with the gateway's and the nodes' signals; the loop overlays the replica counts
              from the actuator (`replicas(key)` asked for, ready, starting), which is the
              truth about what runs.
 2. decide    policy.decide(ctx, state) → Decision, state', with `actuator.capacity()` (the bounds on
              serving nodes its machine or cluster puts now: capacity.py) in the context.
 3. act       for each key whose desired count differs: prepare(key, n) (pre-stage shards)
              before a scale-up, then scale(key, n).
 4. record    `last` (a TickReport: decision, what was asked, error) for `pdserve status`;
              `publish(report, nodes)` hands every tick's report to the caller — failed and
              backing-off ticks too, with nodes {} — which shows it in `pdserve status`
              (autoscaler/observer.py posts it to the gateway).

Failures never leave the loop: an observe or actuator error backs the actuator off
(Throttler: exponential, or the error's own delay), is logged, counted and shown in
`last`; a failure during `prepare` is logged and the scale-up goes ahead.

Concurrency: `run()` runs in the calling thread (`start()` gives it a daemon thread);
`stop()` sets a threading.Event that also cuts the wait between ticks short. `wake()` (any
thread: the gateway's activator calls it when it holds a request for a model at zero) cuts
the current wait short so the next tick runs at once; wakes while a tick runs make the next
wait end at once, and ticks stay at least MIN_GAP_S apart however often wake() is called.
`last` is replaced by one assignment per tick, so other threads read it without a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace

from .actuator import Actuator, NodeInfo, TemporaryActuatorError
from .backoff import Backoff, Throttler
from .config import AutoscalerConfig
from .policy import Decision, PolicyContext, PolicyState, RoleLoad, decide, key_str

log = logging.getLogger("pdserve.autoscaler")

Key = Hashable  # (model, role) with the warm pool
Observe = Callable[[], Mapping[Key, RoleLoad]]
Publish = Callable[["TickReport", Mapping[Key, list[NodeInfo]]], None]
MIN_GAP_S = 0.05  # wake() never makes ticks closer than this


@dataclass(slots=True, frozen=True)
class TickReport:
    """What one tick saw and did."""

    t: float  # loop clock
    decision: Decision | None  # None when the tick failed or was skipped while backing off
    asked: Mapping[Key, int] = field(default_factory=dict)  # key -> replicas asked of the actuator this tick
    error: str = ""  # this tick's failure, "" if none
    failures: int = 0  # consecutive failed ticks
    note: str = ""  # e.g. "backing off: 3s left"
    capacity: tuple = ()  # the actuator's CapacityBounds this tick (what `pdserve status` says held a scale-up)

    def to_dict(self) -> dict:
        return {"t": self.t, "decision": self.decision.to_dict() if self.decision else None,
                "asked": {key_str(k): n for k, n in self.asked.items()},
                "error": self.error, "failures": self.failures, "note": self.note,
                "capacity": [b.to_dict() for b in self.capacity]}  # fmt: skip


class ControlLoop:
    def __init__(self, config: AutoscalerConfig, observe: Observe, actuator: Actuator, *,
                 clock: Callable[[], float] = time.monotonic, backoff: Backoff | None = None,
                 publish: Publish | None = None):  # fmt: skip
        self.config = config
        self.observe = observe
        self.actuator = actuator
        self.clock = clock
        self.publish = publish
        self.throttler = Throttler(backoff or Backoff(base_s=config.tick_s, max_s=max(30.0, config.tick_s)))
        self.state = PolicyState()
        self.last: TickReport | None = None  # the latest tick
        self.last_decision: Decision | None = None  # the latest tick that decided
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one tick ---

    def tick(self) -> TickReport:
        now = self.clock()
        t = self.throttler
        if not t.ready(now):
            report = TickReport(t=now, decision=None, error=t.last_error, failures=t.failures,
                                note=f"backing off: {t.until - now:.1f}s left")  # fmt: skip
            self.last = report
            self._publish(report, {})
            return report
        asked: dict[Key, int] = {}
        try:
            nodes = self.actuator.current()
            loads = self._loads(self.observe(), nodes, now)
            bounds = tuple(getattr(self.actuator, "capacity", tuple)())
            decision, self.state = decide(PolicyContext(self.config, loads, now, bounds), self.state)
            self.last_decision = decision
            for key, d in decision.roles.items():
                if d.replicas == d.current:
                    continue
                if d.replicas > d.current:
                    self._prepare(key, d.replicas)
                self.actuator.scale(key, d.replicas)
                asked[key] = d.replicas
                log.info("autoscaler: %s %d -> %d: %s", key_str(key), d.current, d.replicas, d.reason)
        except Exception as e:  # noqa: BLE001 — a failed tick never ends the loop
            delay = e.delay if isinstance(e, TemporaryActuatorError) else None
            wait = t.failure(now, e, delay)
            level = logging.ERROR if t.repeated else logging.WARNING
            log.log(
                level, "autoscaler: tick failed (%d in a row), next try in %.1fs: %s", t.failures, wait, t.last_error
            )
            report = TickReport(t=now, decision=None, asked=asked, error=t.last_error, failures=t.failures,
                                note="repeated failures" if t.repeated else "")  # fmt: skip
            self.last = report
            self._publish(report, {})
            return report
        t.success()
        report = TickReport(t=now, decision=decision, asked=asked, capacity=bounds)
        self.last = report
        self._publish(report, nodes)
        return report

    def _loads(self, observed: Mapping[Key, RoleLoad], nodes: Mapping[Key, list[NodeInfo]],
               now: float) -> dict[Key, RoleLoad]:  # fmt: skip
        """The observed signals, with replica counts from the actuator."""
        out = {}
        for key, load in observed.items():
            replicas = self.actuator.replicas(key)
            ready = sum(1 for n in nodes.get(key, []) if n.ready)
            out[key] = replace(load, replicas=replicas, ready=min(ready, replicas),
                                starting=max(0, replicas - ready), t=load.t or now)  # fmt: skip
        return out

    def _prepare(self, key: Key, replicas: int) -> None:
        try:
            self.actuator.prepare(key, replicas)
        except Exception as e:  # noqa: BLE001 — a cold start is slower, not wrong
            log.warning("autoscaler: prepare %s x%d failed, scaling anyway: %s", key_str(key), replicas, e)

    def _publish(self, report: TickReport, nodes: Mapping[Key, list[NodeInfo]]) -> None:
        if self.publish is None:
            return
        try:
            self.publish(report, nodes)
        except Exception as e:  # noqa: BLE001 — the registry catches up next tick
            log.warning("autoscaler: publish failed: %s", e)

    # --- running ---

    def run(self, max_ticks: int | None = None, wait: Callable[[float], bool] | None = None) -> int:
        """Tick every config.tick_s until stop() (or max_ticks); returns the ticks run.

        `wait(seconds) -> stopped` defaults to waiting for stop() or wake(); tests pass one that
        advances a fake clock.
        """
        wait = wait or self._wait
        ticks = 0
        while not self._stop.is_set() and (max_ticks is None or ticks < max_ticks):
            started = self.clock()
            self.tick()
            ticks += 1
            if max_ticks is not None and ticks >= max_ticks:
                break
            if wait(max(0.0, self.config.tick_s - (self.clock() - started))):
                break
        return ticks

    def wake(self, model: str | None = None) -> None:
        """Run the next tick now rather than at the end of the wait (thread-safe; e.g. a request is held).

        `model` (the one a request is held for) is accepted so this can be the gateway's `activate`
        as it is; the tick observes every model anyway."""
        self._wake.set()

    def _wait(self, seconds: float) -> bool:
        """Until `seconds` pass, stop() or wake(); -> stopped. A wake still leaves MIN_GAP_S since the last tick."""
        started = time.monotonic()
        self._wake.wait(seconds)
        self._wake.clear()
        if not self._stop.is_set():
            self._stop.wait(max(0.0, min(seconds, MIN_GAP_S) - (time.monotonic() - started)))
        return self._stop.is_set()

    def start(self) -> ControlLoop:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("control loop already running")
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self.run, name="pdserve-autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._wake.set()  # ends the wait between ticks
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> dict:
        """For `pdserve status`: the last decision (and why), the last tick's error and the failure count."""
        return {"last_decision": self.last_decision.to_dict() if self.last_decision else None,
                "last_tick": self.last.to_dict() if self.last else None,
                "failures": self.throttler.failures, "last_error": self.throttler.last_error}  # fmt: skip
