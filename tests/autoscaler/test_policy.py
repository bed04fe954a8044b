"""The scaling policy, tick by tick on a fake clock: windows, bounds, stabilisation, activation, scale to zero.

What one replica carries, the SLO signals and the demand terms (autoscaler/slo.py) are in test_slo.py."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from autoscaler import AutoscalerConfig, PolicyContext, PolicyState, RoleLoad, decide
from tests.autoscaler.policy_cases import D, M, P, Sim, config, rep, streams, tokens


def test_steady_load_holds():
    sim = Sim(config(), prefill=2)
    ds = sim.run(180, prefill=tokens(1500))
    assert {d.replicas[P] for d in ds} == {2}
    assert not any(d.roles[P].panic for d in ds)
    assert ds[-1].roles[P].reason.startswith("stable: 60s load 1.5 replicas (queued prompt tokens)")


def test_10x_burst_enters_panic_and_scales_up_within_two_ticks():
    sim = Sim(config(), prefill=2)
    sim.run(60, prefill=tokens(1500))
    burst = sim.run(2, prefill=tokens(15000))
    assert burst[-1].roles[P].panic
    assert burst[-1].replicas[P] > 2
    assert burst[-1].roles[P].reason.startswith("panic: 6s load ")
    assert "x capacity" in burst[-1].roles[P].reason
    more = sim.run(6, prefill=tokens(15000))
    assert more[-1].replicas[P] == 15  # the whole burst, long before the 60 s window sees it


def test_panic_never_scales_down_and_ends_a_stable_window_after_the_burst():
    cfg = config()
    sim = Sim(cfg, prefill=2)
    sim.run(60, prefill=tokens(1500))
    sim.run(8, prefill=tokens(15000))
    peak = sim.replicas[P]
    after = sim.run(200, prefill=tokens(500))  # the burst is over
    in_panic = [d for d in after if d.roles[P].panic]
    assert in_panic and all(d.replicas[P] == peak for d in in_panic)
    leave = next(i for i, d in enumerate(after) if not d.roles[P].panic)
    assert 50 <= leave <= 62  # calm for a full stable window since the last over-threshold tick
    assert after[leave].roles[P].reason.startswith("leaving panic (calm for 60s)")
    counts = [d.replicas[P] for d in after]
    assert all(b <= a for a, b in itertools.pairwise(counts))  # once down, only down
    assert counts[-1] == 1


def test_leaving_panic_when_the_stable_window_catches_up():
    sim = Sim(config(), prefill=2)
    sim.run(60, prefill=tokens(1500))
    ds = sim.run(90, prefill=tokens(15000))  # a burst that stays
    counts = [d.replicas[P] for d in ds]
    assert all(b >= a for a, b in itertools.pairwise(counts))
    leave = next(
        i for i, d in enumerate(ds) if i > 0 and ds[i - 1].roles[P].panic and not d.roles[P].panic
    )
    assert ds[leave].roles[P].reason.startswith("leaving panic (stable window caught up)")
    assert ds[-1].replicas[P] == 15 and not ds[-1].roles[P].panic


def test_scale_down_waits_for_cooldown_and_respects_the_max_rate():
    sim = Sim(config(), prefill=16)
    ds = sim.run(160, prefill=tokens(0))
    counts = [d.replicas[P] for d in ds]
    assert counts[:28] == [16] * 28  # a fresh policy waits a cooldown before cutting
    assert ds[10].roles[P].reason.startswith("cooldown: 20s left (load wants 1, holding 16)")
    changes = [(i, a, b) for i, (a, b) in enumerate(zip([16] + counts, counts)) if a != b]
    assert [(a, b) for _, a, b in changes] == [(16, 12), (12, 8), (8, 4), (4, 2), (2, 1)]  # <= 4 and <= half each
    gaps = [j - i for (i, *_), (j, *_) in itertools.pairwise(changes)]
    assert all(g >= 30 for g in gaps)  # cooldown since the last change
    assert "scale-down rate: 16 -> 12 (load wants 1)" in ds[changes[0][0]].roles[P].reason


def test_scale_down_fraction_without_step_limit():
    sim = Sim(config(max_scale_down_step=0, scale_down_delay_s=0.0), prefill=16)
    counts = [d.replicas[P] for d in sim.run(5, prefill=tokens(0))]
    assert counts == [8, 4, 2, 1, 1]


def test_bounds_clamp_both_ways():
    sim = Sim(config(prefill_max_replicas=5, decode_min_replicas=3), prefill=1, decode=3)
    d = sim.run(8, prefill=tokens(50_000))[-1]
    assert d.replicas[P] == 5
    assert d.roles[P].reason.startswith("bounds: max 5 (load wants")
    ds = sim.run(200, prefill=tokens(50_000))
    assert {x.replicas[D] for x in ds} == {3}
    assert ds[-1].roles[D].reason == "bounds: min 3 (load wants 0)"


def test_scale_to_zero_then_activation_on_the_first_queued_request():
    cfg = config(prefill_min_replicas=0, decode_min_replicas=0)
    sim = Sim(cfg, prefill=1, decode=1)
    sim.run(200)
    assert sim.of() == {"prefill": 0, "decode": 0}
    d = sim.tick(prefill={"queue_depth": 1, "queued_prompt_tokens": 12})
    assert rep(d) == {"prefill": 1, "decode": 1}  # at once: no window, no delay
    assert d.roles[P].activation and d.roles[P].reason == "activation: 1 queued, 0 replicas"
    assert d.roles[D].activation and d.roles[D].reason == "activation: other role woke, 0 replicas"
    # the woken replicas stay for a cooldown even when the request is done quickly
    assert {x.replicas[P] for x in sim.run(25)} == {1}


def test_activation_without_coactivation_wakes_only_the_queued_role():
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0, coactivate_roles=False), prefill=0, decode=0)
    d = sim.tick(prefill={"queue_depth": 2})
    assert rep(d) == {"prefill": 1, "decode": 0}
    assert not d.roles[D].activation


def test_no_activation_when_min_is_not_zero_or_nothing_queued():
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0), prefill=0, decode=0)
    assert rep(sim.tick()) == {"prefill": 0, "decode": 0}


def test_prefill_and_decode_scale_independently():
    sim = Sim(config(), prefill=1, decode=2)
    ds = sim.run(10, prefill=tokens(12_000), decode={"running_streams": 12, "kv_utilisation": 0.3})
    assert rep(ds[-1]) == {"prefill": 12, "decode": 2}
    assert any(d.roles[P].panic for d in ds) and not any(d.roles[D].panic for d in ds)
    assert {d.replicas[D] for d in ds} == {2}


def test_long_queue_waits_veto_scale_down():
    sim = Sim(config(target_queue_wait_p99_s=1.0, slo_queue_wait_s=0.0, scale_down_delay_s=0.0), prefill=4)
    ds = sim.run(20, prefill={"queue_wait_p99_s": 1.6, "queue_wait_p50_s": 0.4})
    assert {d.replicas[P] for d in ds} == {4}
    assert ds[-1].roles[P].reason == "queue wait p99 1.60s > 1s target: holding 4 (load wants 1)"
    assert sim.tick(prefill={"queue_wait_p99_s": 0.2}).replicas[P] == 2  # waits back to normal: cut


def test_decide_is_pure():
    cfg = config()
    loads = {P: RoleLoad(model=M, replicas=2, ready=2, queued_prompt_tokens=9000, t=1.0)}
    state = PolicyState()
    a, s1 = decide(PolicyContext(cfg, loads, 1.0), state)
    b, s2 = decide(PolicyContext(cfg, loads, 1.0), state)
    assert a == b and s1 == s2 and state == PolicyState()
    assert set(a.roles) == {P}  # a key not observed is not decided
    out = a.to_dict()["roles"]["m/prefill"]
    assert (out["replicas"], out["model"], out["role"]) == (a.replicas[P], M, "prefill")
    assert a.reason.startswith("m/prefill: ")


def test_a_plain_role_key_is_one_unnamed_model():
    """A role-level actuator driven directly (no warm pool): keys "prefill"/"decode" are the model ""."""
    loads = {r: RoleLoad(replicas=1, ready=1, queued_prompt_tokens=30_000, queue_depth=20) for r in ("prefill", "decode")}
    d, _ = decide(PolicyContext(config(), loads, 1.0), PolicyState())
    assert set(d.replicas) == {"prefill", "decode"} and set(d.to_dict()["roles"]) == {"prefill", "decode"}
    assert d.roles["prefill"].model == "" and d.reason.startswith("prefill: ")


@pytest.mark.parametrize("kw", [
    {"tick_s": 0}, {"prefill_min_replicas": 3, "prefill_max_replicas": 2}, {"decode_max_replicas": 0},
    {"panic_window_s": 60.0}, {"panic_threshold": 1.0}, {"max_scale_down_fraction": 0.0},
    {"target_kv_utilisation": 1.5}, {"max_scale_down_step": -1}, {"prefill_min_replicas": -1},
    {"slo_ttft_s": -1.0}, {"slo_tpot_s": float("nan")}, {"slo_queue_wait_s": float("inf")},
    {"scale_to_zero_after_s": -5.0}, {"pool_size": -1}, {"pool_size": 1.5},
])  # fmt: skip
def test_config_rejects_bad_knobs(kw):
    with pytest.raises(ValueError, match="invalid autoscaler config"):
        AutoscalerConfig(**kw)


def test_config_from_mapping():
    cfg = AutoscalerConfig.from_mapping(
        {"prefill_min_replicas": "0", "panic_window_s": "4", "coactivate_roles": "false", "decode_max_replicas": 16}
    )
    assert (cfg.prefill_min_replicas, cfg.panic_window_s, cfg.coactivate_roles, cfg.decode_max_replicas) == (
        0,
        4.0,
        False,
        16,
    )
    with pytest.raises(ValueError, match="unknown autoscaler config keys: nope"):
        AutoscalerConfig.from_mapping({"nope": 1})
    with pytest.raises(ValueError, match="expected int"):
        AutoscalerConfig.from_mapping({"decode_max_replicas": "2.5"})


# --- scale to zero, many models ------------------------------------------------------------------------


def test_idle_model_scales_to_zero_then_a_held_request_activates_both_roles_in_one_tick():
    cfg = config(scale_to_zero_after_s=120.0)  # min 1 per role: scale to zero overrides it for an idle model
    sim = Sim(cfg, prefill=2, decode=2)
    idle = [sim.tick(prefill={"idle_s": t}, decode={"idle_s": t}) for t in range(1, 200)]
    first_zero = next(i for i, d in enumerate(idle) if rep(d) == {"prefill": 0, "decode": 0})
    assert all(rep(d) != {"prefill": 0, "decode": 0} for d in idle[:first_zero])
    assert first_zero + 1 == 120  # idle_s 120 is the first tick at the threshold: both roles at once
    assert idle[first_zero].roles[P].reason == "scale to zero: idle 120s >= 120s"
    assert idle[-1].roles[D].reason == "at zero: nothing held or queued" and sim.of() == {"prefill": 0, "decode": 0}
    # a request for it: held by the gateway's activator (counted in queue_depth too)
    d = sim.tick(prefill={"held": 1, "queue_depth": 1}, decode={"held": 1, "queue_depth": 1})
    assert rep(d) == {"prefill": 1, "decode": 1}
    assert d.roles[P].activation and d.roles[D].activation and d.roles[P].reason == "activation: 1 held, 0 replicas"
    # woken, busy again: min 1 holds
    assert {rep(x)["decode"] for x in sim.run(30, decode={"running_streams": 1})} == {1}


def test_a_model_with_work_or_a_recent_request_is_not_scaled_to_zero():
    sim = Sim(config(scale_to_zero_after_s=60.0, prefill_min_replicas=0, decode_min_replicas=0))
    ds = sim.run(100, prefill={"idle_s": 500.0}, decode={"idle_s": 500.0, "running_streams": 1})
    assert {rep(d)["decode"] for d in ds} == {1}  # a stream still decoding: not idle, whatever the clock says
    off = Sim(config(scale_to_zero_after_s=0.0), prefill=0, decode=0)  # 0 = never: the min brings it back
    assert rep(off.tick()) == {"prefill": 1, "decode": 1}
    on = Sim(config(), prefill=0, decode=0)  # at zero with nothing held: stays there, whatever the min
    assert rep(on.tick()) == {"prefill": 0, "decode": 0}


def test_two_models_are_decided_independently():
    sim = Sim(config(), prefill=1, decode=1, b__prefill=2, b__decode=1)
    B_P, B_D = ("b", "prefill"), ("b", "decode")
    ds = [sim.step({D: streams(60, capacity=10.0), B_P: tokens(1500), B_D: streams(3, capacity=10.0)})
          for _ in range(10)]  # fmt: skip
    assert rep(ds[-1]) == {"prefill": 1, "decode": 6} and any(d.roles[D].panic for d in ds)
    assert {rep(d, "b")["prefill"] for d in ds} == {2} and not any(d.roles[B_P].panic for d in ds)
    assert {rep(d, "b")["decode"] for d in ds} == {1}
    assert {k: d.model for k, d in ds[-1].roles.items()} == {P: M, D: M, B_P: "b", B_D: "b"}
    assert set(ds[-1].to_dict()["roles"]) == {"m/prefill", "m/decode", "b/prefill", "b/decode"}
    # one model held at zero while the other one wakes: activation is per model
    sim = Sim(config(), prefill=0, decode=0, b__prefill=0, b__decode=0)
    d = sim.step({B_P: {"held": 2, "queue_depth": 2}, B_D: {"held": 2, "queue_depth": 2}})
    assert rep(d) == {"prefill": 0, "decode": 0} and rep(d, "b") == {"prefill": 1, "decode": 1}


# --- swaps, loading replicas --------------------------------------------------------------------------


def test_an_evicted_model_stays_at_zero_through_cooldown_and_a_stale_ttft_breach():
    cfg = config(prefill_min_replicas=0, decode_min_replicas=0, scale_down_delay_s=30.0, scale_to_zero_after_s=0.0)
    sim = Sim(cfg, prefill=1, decode=1, b__prefill=0, b__decode=0)
    B_P, B_D = ("b", "prefill"), ("b", "decode")
    busy = {"queued_prompt_tokens": 300, "queue_depth": 1, "ttft_p99_s": 5.0, "requests_per_s": 2.0}
    sim.run(20, prefill=busy, decode={"running_streams": 3, "requests_per_s": 2.0})
    assert sim.of() == {"prefill": 1, "decode": 1}
    # a claim for b evicts m: the pool sets m's replicas to 0; m's last requests finished, its 60 s p99 remembers
    sim.replicas.update({P: 0, D: 0})
    stale = {"ttft_p99_s": 5.0, "queue_wait_p99_s": 3.0, "idle_s": 5.0}
    ds = [sim.step({P: stale, D: stale | {"tpot_p99_s": 1.0}, B_P: {"held": 1, "queue_depth": 1},
                    B_D: {"held": 1, "queue_depth": 1}}) for _ in range(90)]  # fmt: skip
    assert {rep(d)["prefill"] for d in ds} == {0} and {rep(d)["decode"] for d in ds} == {0}
    assert ds[0].roles[P].reason == "at zero: no demand (nothing held, queued, running or arriving)"
    assert rep(ds[0], "b") == {"prefill": 1, "decode": 1}
    # the next request for m is held: woken, and its held wait in the p99 pushes nothing for slo_window_s
    d = sim.step({P: stale | {"held": 1, "queue_depth": 1}, D: stale | {"held": 1, "queue_depth": 1}})
    assert rep(d) == {"prefill": 1, "decode": 1} and d.roles[P].activation
    after = sim.run(int(cfg.slo_window_s) - 2, prefill=busy | {"ttft_p99_s": 9.0}, decode={"running_streams": 1})
    assert {rep(x)["prefill"] for x in after} == {1} and not any(x.roles[P].slo for x in after)
    # a key that never was at zero with traffic reads its p99 at once
    fresh = Sim(config(scale_down_delay_s=0.0), prefill=1)
    assert fresh.run(3, prefill=busy | {"ttft_p99_s": 9.0})[-1].replicas[P] > 1


def test_a_loading_replica_is_not_cut_by_a_stable_window_dip():
    cfg = config(scale_down_delay_s=0.0, prefill_min_replicas=0, scale_to_zero_after_s=30.0)
    dip = RoleLoad(model=M, replicas=2, ready=1, starting=1, queued_prompt_tokens=10, queue_depth=1)
    d, _ = decide(PolicyContext(cfg, {P: dip}, 100.0), PolicyState())
    assert d.replicas[P] == 2 and d.roles[P].reason.startswith("loading: 1 of 2 not ready yet: holding 2")
    ready = replace(dip, ready=2, starting=0)  # once both are ready the dip cuts (no cooldown here)
    assert decide(PolicyContext(cfg, {P: ready}, 100.0), PolicyState())[0].replicas[P] == 1
    # idle past scale_to_zero_after_s and the max bound still cut a loading key
    idle = replace(dip, queued_prompt_tokens=0, queue_depth=0, idle_s=60.0)
    both = {P: idle, D: RoleLoad(model=M, idle_s=60.0, replicas=1, ready=1)}
    assert decide(PolicyContext(cfg, both, 100.0), PolicyState())[0].replicas[P] == 0
    lowered = config(scale_down_delay_s=0.0, prefill_max_replicas=1)
    assert decide(PolicyContext(lowered, {P: dip}, 100.0), PolicyState())[0].replicas[P] == 1
