"""What one replica carries and the SLO signals (autoscaler/slo.py), through the policy on a fake clock:
measured capacity, SLO push and veto, demand (arrival rates)."""

from __future__ import annotations

import itertools

from autoscaler import PolicyContext, PolicyState, RoleLoad, decide
from tests.autoscaler.policy_cases import D, M, P, Sim, config, rep, streams

# --- measured capacity ---------------------------------------------------------------------------------


def test_decode_sizes_on_streams_and_kv_blocks():
    sim = Sim(config(), decode=4)
    d = sim.run(8, decode={"running_streams": 40, "queue_depth": 20})[-1]  # 60 streams / 10 per replica
    assert d.replicas[D] == 6 and "x capacity" not in d.roles[D].reason
    # 3.6 replicas' worth of KV blocks in use, spread over whoever is ready; target 0.5 -> 7.2 replicas
    sim = Sim(config(), decode=4)
    ds = sim.run(30, decode=lambda n: {"running_streams": 4, "kv_utilisation": min(1.0, 3.6 / n)})
    assert "kv blocks" in ds[0].roles[D].reason
    assert ds[-1].replicas[D] == 8 and {d.replicas[D] for d in ds[-10:]} == {8}  # settles, no runaway

def test_measured_capacity_sets_the_replica_count_for_the_same_load():
    """Same 40 streams / 6000 queued prompt tokens; only what the nodes measured differs."""
    def settle(decode=None, prefill=None):
        sim = Sim(config(), prefill=1, decode=1)
        return rep(sim.run(70, decode=decode, prefill=prefill)[-1])

    assert settle(decode=streams(40))["decode"] == 4  # nothing measured: the configured 10 per replica
    assert settle(decode=streams(40, capacity=20.0))["decode"] == 2
    assert settle(decode=streams(40, capacity=5.0))["decode"] == 8
    assert settle(decode=streams(40, capacity=0.3))["decode"] == 32  # < 1 stream measured: still one each, capped
    # prefill: a replica carries prefill_tokens_per_s x slo_ttft_s queued prompt tokens (2 s SLO here)
    queued = {"queued_prompt_tokens": 6000, "queue_depth": 6}
    assert settle(prefill=queued)["prefill"] == 6  # nothing measured: the configured 1000 per replica
    assert settle(prefill=queued | {"prefill_tokens_per_s": 1000.0})["prefill"] == 3
    assert settle(prefill=queued | {"prefill_tokens_per_s": 3000.0})["prefill"] == 1
    sim = Sim(config(), decode=1)
    d = sim.tick(decode=streams(40, capacity=20.0))
    assert "streams, 20.0 per replica measured" in sim.run(70, decode=streams(40, capacity=20.0))[-1].roles[D].reason
    assert d.roles[D].model == M


def test_a_burst_over_measured_capacity_scales_within_the_panic_window():
    cfg = config(target_running_streams_per_replica=32)  # the constant that never fired on a fast box
    sim = Sim(cfg, decode=1)
    sim.run(60, decode=streams(6, capacity=8.0))
    assert sim.of()["decode"] == 1
    burst = sim.run(int(cfg.panic_window_s), decode=streams(40, capacity=8.0))
    assert burst[1].replicas[D] > 1 and burst[1].roles[D].panic  # the 6 s mean passes 2x capacity at tick 2
    assert burst[-1].replicas[D] == 5  # 40 streams / 8 measured, within the 6 s window
    # the same burst judged by the configured constant: 40 / 32 -> 2, no panic
    sim = Sim(cfg, decode=1)
    sim.run(60, decode=streams(6))
    ds = sim.run(int(cfg.panic_window_s), decode=streams(40))
    assert not any(d.roles[D].panic for d in ds) and ds[-1].replicas[D] <= 2
# --- SLOs ----------------------------------------------------------------------------------------------



def test_slo_breach_pushes_one_step_per_cooldown_and_vetoes_scale_down():
    cfg = config(scale_down_delay_s=10.0, decode_max_replicas=4, demand_signal=False)
    sim = Sim(cfg, decode=2)
    sim.run(60, decode=streams(6, capacity=4.0))  # 1.5 replicas' worth: 2 hold
    assert sim.of()["decode"] == 2
    # 10 streams on 2 replicas that carry 4 each at the SLO: 1.25x, under panic; the 60 s mean lags for 30 ticks
    hot = streams(10, capacity=4.0, tpot_p99_s=0.3)
    ds = sim.run(20, decode=hot)
    counts = [d.replicas[D] for d in ds]
    ups = [i for i, (a, b) in enumerate(itertools.pairwise([2, *counts])) if b > a]
    assert counts[ups[0]] == 3 and ups[0] == 0  # the breach, over capacity, adds one at once
    assert ds[0].roles[D].reason == "SLO: TPOT p99 0.30s > 0.2s SLO: 2 -> 3"
    assert len(ups) == 1 and set(counts) == {3}  # 10 / 3 = 3.3 streams per replica: within what one carries
    assert ds[-1].roles[D].slo == "TPOT p99 0.30s > 0.2s SLO"  # still breached: it holds, no more steps
    # the same with the stable window alone: no step until the 60 s mean catches up
    sim = Sim(cfg, decode=2)
    sim.run(60, decode=streams(6, capacity=4.0))
    assert {d.replicas[D] for d in sim.run(20, decode=streams(10, capacity=4.0))} == {2}
    # TTFT and queue wait speak for prefill; while breached without work they hold, never push
    sim = Sim(config(scale_down_delay_s=0.0), prefill=3)
    d = sim.run(5, prefill={"ttft_p99_s": 5.0})[-1]
    assert d.replicas[P] == 3 and d.roles[P].reason == "SLO: TTFT p99 5.00s > 2s SLO: holding 3 (load wants 1)"
    d = sim.run(3, prefill={"queue_wait_p99_s": 1.5, "queued_prompt_tokens": 100, "queue_depth": 1})[-1]
    assert d.replicas[P] == 6  # one step a tick: no cooldown in this config, and nothing starting


def test_tpot_over_its_slo_at_low_load_adds_no_replica_but_vetoes_the_cut():
    cfg = config(scale_down_delay_s=10.0, decode_max_replicas=4)
    # 4 streams on 2 replicas that carry 20 each: the gateway's TPOT p99 (handoff gap included) is 3x its SLO
    sim = Sim(cfg, decode=2)
    ds = sim.run(45, decode=streams(4, capacity=20.0, tpot_p99_s=0.6))
    assert {d.replicas[D] for d in ds} == {2}  # never pushed up, never cut while breached
    assert ds[-1].roles[D].reason == "SLO: TPOT p99 0.60s > 0.2s SLO: holding 2 (load wants 1)"
    # the same p99 with the streams beyond what 2 replicas carry (45 > 2 x 20): one more, at once
    sim = Sim(config(scale_down_delay_s=10.0, decode_max_replicas=4, stable_window_s=600.0, panic_window_s=6.0,
                     demand_signal=False), decode=2)  # fmt: skip
    sim.run(30, decode=streams(30, capacity=20.0))
    d = sim.tick(decode=streams(45, capacity=20.0, tpot_p99_s=0.6))
    assert d.replicas[D] == 3 and d.roles[D].reason == "SLO: TPOT p99 0.60s > 0.2s SLO: 2 -> 3"
    # the breach over (p99 back under its SLO): the load's own count wins after the cooldown
    sim = Sim(cfg, decode=3)
    after = sim.run(80, decode=streams(4, capacity=20.0, tpot_p99_s=0.05))
    assert after[-1].replicas[D] < 3 and not after[-1].roles[D].slo


def test_slo_step_waits_for_a_starting_replica():
    sim = Sim(config(scale_down_delay_s=0.0), decode=2)
    load = RoleLoad(model=M, replicas=3, ready=2, starting=1, running_streams=25, tpot_p99_s=0.5)  # 3 replicas' worth
    d, _ = decide(PolicyContext(sim.cfg, {D: load}, 100.0), PolicyState())
    assert d.replicas[D] == 3 and d.roles[D].reason == "SLO: TPOT p99 0.50s > 0.2s SLO: waiting for 1 starting"

def test_the_wait_of_requests_held_at_activation_is_no_reason_to_scale_up():
    cfg = config(scale_down_delay_s=5.0)
    sim = Sim(cfg, prefill=0, decode=0)
    sim.tick(prefill={"held": 1, "queue_depth": 1}, decode={"held": 1, "queue_depth": 1})
    assert sim.of() == {"prefill": 1, "decode": 1}
    # the held request's 3 s TTFT sits in the gateway's 60 s p99 while traffic goes on
    busy_slow = {"queued_prompt_tokens": 200, "queue_depth": 1, "ttft_p99_s": 3.0}
    ds = sim.run(int(cfg.stable_window_s) - 2, prefill=busy_slow)
    assert {rep(d)["prefill"] for d in ds} == {1} and not any(d.roles[P].slo for d in ds)
    later = sim.run(10, prefill=busy_slow)  # still breached a stable window later: now it is a real signal
    assert later[-1].replicas[P] > 1 and "TTFT p99 3.00s > 2s SLO" in later[-1].roles[P].slo

# --- demand (arrival rates) ----------------------------------------------------------------------------


def _burst_run(demand_signal: bool) -> list:
    """A prefill key on a 0.5 s tick fed by the gateway's own Traffic (fake clock) and a simulated queue:
    1.25 req/s of 40-token prompts for 60 s, then 14 req/s (3x what one replica measured at 188 tok/s clears).
    Returns the decisions after the onset."""
    from gateway.admission.traffic import Traffic

    clock = [1000.0]
    traffic = Traffic(clock=lambda: clock[0], wall=lambda: clock[0])
    cfg = config(tick_s=0.5, panic_window_s=2.0, demand_signal=demand_signal, target_queue_wait_p99_s=0.0)
    state, replicas, queued, owed, out = PolicyState(), 1, 0.0, 0.0, []
    for k in range(140):
        rate = 1.25 if k < 120 else 14.0
        t0, owed = clock[0], owed + rate * cfg.tick_s
        n = int(owed)
        owed -= n
        for i in range(n):  # this tick's arrivals, evenly spaced in it
            clock[0] = t0 + (i + 1) * cfg.tick_s / (n + 1)
            traffic.arrived(M, 40, 16)
            queued += 40
        clock[0] = t0 + cfg.tick_s
        queued = max(0.0, queued - replicas * 188.0 * cfg.tick_s)
        g = traffic.snapshot(M)
        load = RoleLoad(model=M, replicas=replicas, ready=replicas, queued_prompt_tokens=int(queued),
                        queue_depth=int(queued // 40), prefill_tokens_per_s=188.0, t=clock[0],
                        requests_per_s=g["requests_per_s"], prompt_tokens_per_s=g["prompt_tokens_per_s"],
                        recent_requests=g["recent_requests"])  # fmt: skip
        d, state = decide(PolicyContext(cfg, {P: load}, clock[0]), state)
        replicas = d.replicas[P]
        if k >= 120:
            out.append(d)
    return out


def test_a_step_in_arrival_rate_beyond_measured_capacity_scales_up_within_two_ticks():
    on, off = _burst_run(demand_signal=True), _burst_run(demand_signal=False)
    first_on = next(i for i, d in enumerate(on) if d.replicas[P] > 1)
    first_off = next((i for i, d in enumerate(off) if d.replicas[P] > 1), len(off))
    assert first_on <= 1 and on[first_on].roles[P].panic  # the 2nd tick after the onset at the latest (1 s)
    assert on[first_on].roles[P].reason.startswith("panic: 2s load ")
    assert "(prompt demand 320 tok/s, 188 measured)" in on[0].roles[P].reason  # half the step seen after 1 tick
    assert on[-1].replicas[P] >= 3  # 560 tok/s / 188: 3 replicas
    # the same arrivals judged by the queue alone: the queue must first grow past 2 replicas' TTFT budget
    assert first_off >= first_on + 3, (first_on, first_off)

def test_one_long_request_in_a_quiet_second_is_no_burst():
    cfg = config(tick_s=0.5, panic_window_s=2.0)
    sim = Sim(cfg, prefill=1, decode=1)
    quiet = {"prefill_tokens_per_s": 188.0}
    sim.run(120, prefill=quiet, decode={"capacity_streams": 7.0, "decode_tokens_per_s": 71.0})
    # one 1000-token prompt with max_tokens 2048: as rates over the gateway's 1 s, 5x and 29x what a replica does
    one = {"recent_requests": 1, "requests_per_s": 1.0}
    ds = sim.run(4, prefill=quiet | one | {"prompt_tokens_per_s": 1000.0, "queued_prompt_tokens": 1000, "queue_depth": 1},
                 decode={"capacity_streams": 7.0, "decode_tokens_per_s": 71.0, "output_tokens_per_s": 2048.0,
                         "running_streams": 1} | one)  # fmt: skip
    assert {rep(d)["prefill"] for d in ds} == {1} and {rep(d)["decode"] for d in ds} == {1}
    assert not any(d.roles[P].panic or d.roles[D].panic for d in ds)
    # ten such requests in that second: a burst
    ten = {"recent_requests": 10, "requests_per_s": 10.0}
    d = sim.tick(prefill=quiet | ten | {"prompt_tokens_per_s": 10000.0},
                 decode={"capacity_streams": 7.0, "decode_tokens_per_s": 71.0, "output_tokens_per_s": 20480.0,
                         "running_streams": 8} | ten)  # fmt: skip
    assert d.roles[P].panic and rep(d)["prefill"] == 10 and d.roles[D].panic and rep(d)["decode"] == 3
