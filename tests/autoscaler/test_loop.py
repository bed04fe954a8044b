"""The control loop with the fake actuator and a fake clock: observe → decide → act, failures backed off."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from autoscaler import (
    AutoscalerConfig,
    Backoff,
    ControlLoop,
    PermanentActuatorError,
    RoleLoad,
    TemporaryActuatorError,
    actuator_kinds,
    make_actuator,
)
from autoscaler.fake import FakeActuator
from tests.services import wait_for

P, D = ("m", "prefill"), ("m", "decode")  # the keys: (model, role)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> bool:  # the loop's `wait`: never stopped
        self.t += s
        return False


def cfg(**kw) -> AutoscalerConfig:
    return AutoscalerConfig(
        **(
            {
                "tick_s": 1.0,
                "target_queued_prompt_tokens_per_replica": 1000,
                "target_running_streams_per_replica": 10,
                "scale_down_delay_s": 5.0,
                "panic_window_s": 6.0,
            }
            | kw
        )
    )


class Gateway:
    """What the gateway reports: signals per (model, role) (replica counts come from the actuator)."""

    def __init__(self):
        self.prefill_tokens = 0
        self.decode_streams = 0
        self.fail = 0

    def __call__(self):
        if self.fail:
            self.fail -= 1
            raise ConnectionError("gateway unreachable")
        return {P: RoleLoad(model="m", queued_prompt_tokens=self.prefill_tokens, queue_depth=self.prefill_tokens // 500),
                D: RoleLoad(model="m", running_streams=self.decode_streams)}  # fmt: skip


def setup(start_delay_s: float = 0.0, **kw):
    clock, gw = Clock(), Gateway()
    act = FakeActuator({P: 1, D: 1}, start_delay_s=start_delay_s, clock=clock)
    published = []
    loop = ControlLoop(cfg(**kw), gw, act, clock=clock, backoff=Backoff(base_s=1.0, factor=2.0, max_s=8.0),
                       publish=lambda report, nodes: published.append((report, nodes)))  # fmt: skip
    return clock, gw, act, loop, published


def test_burst_scales_up_with_prepare_first_and_records_the_decision():
    clock, gw, act, loop, published = setup(start_delay_s=3.0)
    assert loop.run(max_ticks=10, wait=clock.advance) == 10
    assert act.replicas(P) == 1 and not [c for c in act.calls if c[0] == "scale"]
    gw.prefill_tokens = 8000
    loop.run(max_ticks=8, wait=clock.advance)
    assert act.replicas(P) == 8 and act.replicas(D) == 1
    scales = [c for c in act.calls if c[0] in ("scale", "prepare")]
    assert scales[0][0] == "prepare" and scales[1][0] == "scale"  # warm the shards, then start the nodes
    assert all(c[1] == P for c in scales)
    d = loop.last_decision.roles[P]
    assert d.replicas == 8 and d.reason.startswith("panic:")
    status = loop.status()
    assert status["last_decision"]["roles"]["m/prefill"]["replicas"] == 8 and status["failures"] == 0
    asked = [r.to_dict()["asked"] for r, _ in published if r.asked]
    assert asked and all(set(a) == {"m/prefill"} for a in asked) and asked[-1]["m/prefill"] == 8  # JSON: "model/role"
    # new nodes come up "loading" and turn ready after start_delay_s; the loop sees them as starting meanwhile
    _, nodes = published[-1]
    assert len(nodes[P]) == 8 and any(not n.ready for n in nodes[P])
    assert all(n.role == "prefill" and n.name.startswith("m-prefill-") for n in nodes[P])
    loop.run(max_ticks=4, wait=clock.advance)
    assert all(n.ready for n in act.current()[P])


def test_scale_down_drains_the_removed_nodes():
    clock, gw, act, loop, _ = setup()
    gw.prefill_tokens = 4000
    loop.run(max_ticks=6, wait=clock.advance)
    assert act.replicas(P) == 4
    gw.prefill_tokens = 0
    loop.run(max_ticks=200, wait=clock.advance)
    assert act.replicas(P) == 1
    assert len(act.drained) == 3 and all(n.state == "draining" and n.role == "prefill" for n in act.drained)


def test_two_models_over_keys_one_scaled_to_zero_and_woken_by_a_held_request():
    clock = Clock()
    BP, BD = ("b", "prefill"), ("b", "decode")
    act = FakeActuator({P: 1, D: 1, BP: 1, BD: 1}, clock=clock)
    since = {"m": 0.0, "b": 0.0}  # when each model's last request came
    held = {"b": 0}

    def observe():
        out = {}
        for (model, role) in (P, D, BP, BD):
            busy = {"running_streams": 30, "capacity_streams": 6.0} if model == "m" and role == "decode" else {}
            out[(model, role)] = RoleLoad(model=model, idle_s=clock.t - since[model], held=held.get(model, 0),
                                          queue_depth=held.get(model, 0), **busy)  # fmt: skip
        return out

    loop = ControlLoop(cfg(scale_to_zero_after_s=20.0), observe, act, clock=clock)
    since["m"] = since["b"] = clock.t
    for _ in range(25):
        since["m"] = clock.t  # m keeps being asked
        loop.run(max_ticks=1, wait=clock.advance)
        clock.advance(1.0)
    assert (act.replicas(BP), act.replicas(BD)) == (0, 0)  # b idle for 20 s: both roles to zero at once
    assert (act.replicas(P), act.replicas(D)) == (1, 5)  # m sized on its own: 30 streams / 6 measured
    assert loop.last_decision.roles[BD].reason == "at zero: nothing held or queued"
    held["b"] = 1
    report = loop.tick()
    assert report.asked == {BP: 1, BD: 1} and (act.replicas(BP), act.replicas(BD)) == (1, 1)  # in one tick
    assert report.to_dict()["asked"] == {"b/prefill": 1, "b/decode": 1}


def test_actuator_failures_back_off_and_never_leave_the_loop():
    clock, gw, act, loop, _ = setup()
    gw.prefill_tokens = 5000
    act.fail_next(*(TemporaryActuatorError("HTTP 500") for _ in range(4)))
    reports = [loop.tick()]
    for _ in range(20):
        clock.advance(1.0)
        reports.append(loop.tick())
    failed = [r for r in reports if r.error and not r.note.startswith("backing off")]
    assert [r.failures for r in failed] == [1, 2, 3, 4]
    assert failed[-1].note == "repeated failures" and "TemporaryActuatorError: HTTP 500" in failed[-1].error
    skipped = [r for r in reports if r.note.startswith("backing off")]
    assert len(skipped) == 0 + 1 + 3 + 7  # waits of 1, 2, 4, 8 s between tries on a 1 s tick
    assert act.replicas(P) == 5  # recovered and scaled
    assert reports[-1].error == "" and loop.status()["failures"] == 0


def test_temporary_error_delay_overrides_backoff_and_permanent_errors_are_reported():
    clock, _, act, loop, _ = setup()
    act.fail_next(TemporaryActuatorError("throttled", delay=5.0))
    assert loop.tick().failures == 1
    assert loop.throttler.until == clock.t + 5.0
    clock.advance(5.0)
    act.fail_next(PermanentActuatorError("HTTP 403 Forbidden"))
    r = loop.tick()
    assert r.failures == 2 and "403" in r.error and loop.status()["last_error"] == r.error


def test_observe_failure_acts_on_nothing():
    _, gw, act, loop, _ = setup()
    gw.prefill_tokens, gw.fail = 9000, 1
    r = loop.tick()
    assert r.decision is None and "gateway unreachable" in r.error
    assert not [c for c in act.calls if c[0] == "scale"]


def test_prepare_failure_does_not_block_scale_up():
    clock, gw, act, loop, _ = setup()

    def broken(key, n):
        raise OSError("store unreachable")

    act.prepare = broken
    gw.prefill_tokens = 3000
    loop.run(max_ticks=4, wait=clock.advance)
    assert act.replicas(P) == 3


def test_run_in_a_thread_stops_promptly():
    """A stop interrupts the wait between ticks: the thread ends at once, its hour-long tick cut short (a loop
    that slept out its tick would still be alive when stop()'s join gives up), after exactly the one tick."""
    act = FakeActuator({P: 1, D: 1})
    ticks: list[float] = []
    gw = Gateway()

    def observe():
        ticks.append(time.monotonic())
        return gw()

    loop = ControlLoop(cfg(tick_s=3600.0), observe, act).start()
    with pytest.raises(RuntimeError, match="already running"):
        loop.start()
    wait_for(lambda: loop.last is not None, 60, "the first tick")  # it ran: now it waits out its hour
    loop.stop(timeout=60)
    assert not any(t.name == "pdserve-autoscaler" for t in threading.enumerate())
    assert len(ticks) == 1


def test_wake_cuts_the_wait_short_and_ticks_stay_apart():
    """wake() (the activator's call) runs the next tick at once instead of after the hour-long tick; a storm of
    wakes still leaves ticks at least MIN_GAP_S apart. Order and counts: the storm lasts until 3 more ticks
    ran, however long that takes on this machine, and the bound on the ticks is from its measured length."""
    from autoscaler.loop import MIN_GAP_S

    gw = Gateway()
    ticks: list[float] = []

    def observe():
        ticks.append(time.monotonic())
        return gw()

    loop = ControlLoop(cfg(tick_s=3600.0), observe, FakeActuator({P: 1, D: 1})).start()
    try:
        wait_for(lambda: ticks, 60, "the first tick")
        time.sleep(0.2)
        assert len(ticks) == 1  # waiting out its hour-long tick
        loop.wake("m")  # as the gateway's activator calls it: with the model a request is held for
        wait_for(lambda: len(ticks) >= 2, 60, "the tick a wake runs")
        storm_start, wakes = time.monotonic(), 0
        while len(ticks) < 5:  # wakes far faster than MIN_GAP_S, until 3 more ticks ran
            assert time.monotonic() - storm_start < 60, f"{wakes} wakes ran {len(ticks) - 2} ticks in 60 s"
            loop.wake()
            wakes += 1
            time.sleep(0.001)
        storm_s = time.monotonic() - storm_start
        got = list(ticks)
        gaps = [b - a for a, b in itertools.pairwise(got[1:])]
        assert min(gaps) >= MIN_GAP_S * 0.9  # (the wait's own timer granularity)
        assert len(got) - 2 <= storm_s / MIN_GAP_S + 1, (len(got), storm_s, wakes)  # at most one per MIN_GAP_S
    finally:
        loop.stop()
    assert not any(t.name == "pdserve-autoscaler" for t in threading.enumerate())


def test_factory_registers_backends_lazily():
    assert actuator_kinds() == ["fake", "kubernetes", "local"]
    assert isinstance(make_actuator("fake", replicas={"decode": 2}), FakeActuator)
    with pytest.raises(ValueError, match="unknown actuator 'k8s'"):
        make_actuator("k8s")


def test_a_model_the_pool_evicted_is_not_placed_again_by_its_cooldown_or_its_stale_p99():
    """The swap of `pdserve bench swap`: a claim for b evicts m (the pool drops m's replicas to 0 under the
    loop); m's last requests are done but its 60 s TTFT p99 is over the SLO. Nothing may ask for m again."""
    clock = Clock()
    BP, BD = ("b", "prefill"), ("b", "decode")
    act = FakeActuator({P: 1, D: 1, BP: 0, BD: 0}, start_delay_s=2.0, clock=clock)
    busy_m = {"m": True}

    def observe():
        out = {}
        for model, role in (P, D, BP, BD):
            kw = {"ttft_p99_s": 6.0, "queue_wait_p99_s": 3.0} if model == "m" else {}
            if model == "m" and busy_m["m"]:
                kw |= {"queued_prompt_tokens": 800, "queue_depth": 2, "requests_per_s": 2.0, "recent_requests": 4}
            if model == "b":
                kw |= {"held": 1, "queue_depth": 1}
            out[(model, role)] = RoleLoad(model=model, idle_s=1.0, **kw)
        return out

    loop = ControlLoop(cfg(scale_down_delay_s=30.0, prefill_min_replicas=0, decode_min_replicas=0, scale_to_zero_after_s=0.0),
                       observe, act,
                       clock=clock)  # fmt: skip
    loop.run(max_ticks=5, wait=clock.advance)
    assert (act.replicas(BP), act.replicas(BD)) == (1, 1)  # b woken by its held request
    busy_m["m"] = False
    act.scale(P, 0), act.scale(D, 0)  # the pool evicted m to make room for b
    act.calls.clear()
    loop.run(max_ticks=90, wait=clock.advance)
    assert not [c for c in act.calls if c[0] == "scale" and c[1] in (P, D)]
    assert (act.replicas(P), act.replicas(D)) == (0, 0)
    assert loop.last_decision.roles[P].reason.startswith("at zero: no demand")


def test_a_replica_still_loading_is_not_cut_when_the_load_dips():
    clock, gw, act, loop, _ = setup(start_delay_s=20.0, scale_down_delay_s=0.0)
    gw.prefill_tokens = 1500
    loop.run(max_ticks=3, wait=clock.advance)
    act.scale(P, 3)  # two more asked for a while ago (the stable window's count then), loading for 20 s
    gw.prefill_tokens = 500  # the load dips: the stable window wants 1 or 2
    reports = [loop.tick() for _ in range(15) if not clock.advance(1.0)]
    assert all(r.decision.roles[P].replicas == 3 for r in reports) and not act.drained
    assert reports[-1].decision.roles[P].reason.startswith("loading: 2 of 3 not ready yet: holding 3")
    loop.run(max_ticks=10, wait=clock.advance)  # ready now: the dip cuts
    assert act.replicas(P) < 3 and act.drained
