"""The scaling policy, tick by tick on a fake clock: a simulated cluster obeys each decision at once."""

from __future__ import annotations

import itertools

import pytest

from autoscaler import AutoscalerConfig, PolicyContext, PolicyState, RoleLoad, decide

TOKENS = 1000  # prefill target per replica in these tests


def config(**kw) -> AutoscalerConfig:
    base = {
        "tick_s": 1.0,
        "target_queued_prompt_tokens_per_replica": TOKENS,
        "target_running_streams_per_replica": 10,
        "target_kv_utilisation": 0.5,
        "target_queue_wait_p99_s": 0.0,
        "prefill_min_replicas": 1,
        "prefill_max_replicas": 32,
        "decode_min_replicas": 1,
        "decode_max_replicas": 32,
        "stable_window_s": 60.0,
        "panic_window_s": 6.0,
        "panic_threshold": 2.0,
        "scale_down_delay_s": 30.0,
        "max_scale_down_fraction": 0.5,
        "max_scale_down_step": 4,
    }
    return AutoscalerConfig(**(base | kw))


class Sim:
    """A fake clock and a cluster whose replicas follow the decision at once (all ready)."""

    def __init__(self, cfg: AutoscalerConfig, prefill: int = 1, decode: int = 1):
        self.cfg, self.t, self.state = cfg, 0.0, PolicyState()
        self.replicas = {"prefill": prefill, "decode": decode}
        self.history: list = []

    def tick(self, prefill: dict | None = None, decode: dict | None = None):
        self.t += self.cfg.tick_s
        loads = {}
        for role, kw in (("prefill", prefill), ("decode", decode)):
            n = self.replicas[role]
            kw = kw(n) if callable(kw) else kw  # load may depend on the replicas serving it
            loads[role] = RoleLoad(replicas=n, ready=n, t=self.t, **(kw or {}))
        d, self.state = decide(PolicyContext(self.cfg, loads, self.t), self.state)
        self.replicas.update(d.replicas)
        self.history.append(d)
        return d

    def run(self, ticks: int, **kw):
        return [self.tick(**kw) for _ in range(ticks)]


def tokens(n: int) -> dict:
    return {"queued_prompt_tokens": n, "queue_depth": max(1, n // 500) if n else 0}


def test_steady_load_holds():
    sim = Sim(config(), prefill=2)
    ds = sim.run(180, prefill=tokens(1500))
    assert {d.replicas["prefill"] for d in ds} == {2}
    assert not any(d.roles["prefill"].panic for d in ds)
    assert ds[-1].roles["prefill"].reason.startswith("stable: 60s load 1.5 replicas (queued prompt tokens)")


def test_10x_burst_enters_panic_and_scales_up_within_two_ticks():
    sim = Sim(config(), prefill=2)
    sim.run(60, prefill=tokens(1500))
    burst = sim.run(2, prefill=tokens(15000))
    assert burst[-1].roles["prefill"].panic
    assert burst[-1].replicas["prefill"] > 2
    assert burst[-1].roles["prefill"].reason.startswith("panic: 6s load ")
    assert "x capacity" in burst[-1].roles["prefill"].reason
    more = sim.run(6, prefill=tokens(15000))
    assert more[-1].replicas["prefill"] == 15  # the whole burst, long before the 60 s window sees it


def test_panic_never_scales_down_and_ends_a_stable_window_after_the_burst():
    cfg = config()
    sim = Sim(cfg, prefill=2)
    sim.run(60, prefill=tokens(1500))
    sim.run(8, prefill=tokens(15000))
    peak = sim.replicas["prefill"]
    after = sim.run(200, prefill=tokens(500))  # the burst is over
    in_panic = [d for d in after if d.roles["prefill"].panic]
    assert in_panic and all(d.replicas["prefill"] == peak for d in in_panic)
    leave = next(i for i, d in enumerate(after) if not d.roles["prefill"].panic)
    assert 50 <= leave <= 62  # calm for a full stable window since the last over-threshold tick
    assert after[leave].roles["prefill"].reason.startswith("leaving panic (calm for 60s)")
    counts = [d.replicas["prefill"] for d in after]
    assert all(b <= a for a, b in itertools.pairwise(counts))  # once down, only down
    assert counts[-1] == 1


def test_leaving_panic_when_the_stable_window_catches_up():
    sim = Sim(config(), prefill=2)
    sim.run(60, prefill=tokens(1500))
    ds = sim.run(90, prefill=tokens(15000))  # a burst that stays
    counts = [d.replicas["prefill"] for d in ds]
    assert all(b >= a for a, b in itertools.pairwise(counts))
    leave = next(
        i for i, d in enumerate(ds) if i > 0 and ds[i - 1].roles["prefill"].panic and not d.roles["prefill"].panic
    )
    assert ds[leave].roles["prefill"].reason.startswith("leaving panic (stable window caught up)")
    assert ds[-1].replicas["prefill"] == 15 and not ds[-1].roles["prefill"].panic


def test_scale_down_waits_for_cooldown_and_respects_the_max_rate():
    sim = Sim(config(), prefill=16)
    ds = sim.run(160, prefill=tokens(0))
    counts = [d.replicas["prefill"] for d in ds]
    assert counts[:28] == [16] * 28  # a fresh policy waits a cooldown before cutting
    assert ds[10].roles["prefill"].reason.startswith("cooldown: 20s left (load wants 1, holding 16)")
    changes = [(i, a, b) for i, (a, b) in enumerate(zip([16] + counts, counts)) if a != b]
    assert [(a, b) for _, a, b in changes] == [(16, 12), (12, 8), (8, 4), (4, 2), (2, 1)]  # <= 4 and <= half each
    gaps = [j - i for (i, *_), (j, *_) in itertools.pairwise(changes)]
    assert all(g >= 30 for g in gaps)  # cooldown since the last change
    assert "scale-down rate: 16 -> 12 (load wants 1)" in ds[changes[0][0]].roles["prefill"].reason


def test_scale_down_fraction_without_step_limit():
    sim = Sim(config(max_scale_down_step=0, scale_down_delay_s=0.0), prefill=16)
    counts = [d.replicas["prefill"] for d in sim.run(5, prefill=tokens(0))]
    assert counts == [8, 4, 2, 1, 1]


def test_bounds_clamp_both_ways():
    sim = Sim(config(prefill_max_replicas=5, decode_min_replicas=3), prefill=1, decode=3)
    d = sim.run(8, prefill=tokens(50_000))[-1]
    assert d.replicas["prefill"] == 5
    assert d.roles["prefill"].reason.startswith("bounds: max 5 (load wants")
    ds = sim.run(200, prefill=tokens(50_000))
    assert {x.replicas["decode"] for x in ds} == {3}
    assert ds[-1].roles["decode"].reason == "bounds: min 3 (load wants 0)"


def test_scale_to_zero_then_activation_on_the_first_queued_request():
    cfg = config(prefill_min_replicas=0, decode_min_replicas=0)
    sim = Sim(cfg, prefill=1, decode=1)
    sim.run(200)
    assert sim.replicas == {"prefill": 0, "decode": 0}
    d = sim.tick(prefill={"queue_depth": 1, "queued_prompt_tokens": 12})
    assert d.replicas == {"prefill": 1, "decode": 1}  # at once: no window, no delay
    assert d.roles["prefill"].activation and d.roles["prefill"].reason == "activation: 1 queued, 0 replicas"
    assert d.roles["decode"].activation and d.roles["decode"].reason == "activation: other role woke, 0 replicas"
    # the woken replicas stay for a cooldown even when the request is done quickly
    assert {x.replicas["prefill"] for x in sim.run(25)} == {1}


def test_activation_without_coactivation_wakes_only_the_queued_role():
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0, coactivate_roles=False), prefill=0, decode=0)
    d = sim.tick(prefill={"queue_depth": 2})
    assert d.replicas == {"prefill": 1, "decode": 0}
    assert not d.roles["decode"].activation


def test_no_activation_when_min_is_not_zero_or_nothing_queued():
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0), prefill=0, decode=0)
    assert sim.tick().replicas == {"prefill": 0, "decode": 0}


def test_prefill_and_decode_scale_independently():
    sim = Sim(config(), prefill=1, decode=2)
    ds = sim.run(10, prefill=tokens(12_000), decode={"running_streams": 12, "kv_utilisation": 0.3})
    assert ds[-1].replicas == {"prefill": 12, "decode": 2}
    assert any(d.roles["prefill"].panic for d in ds) and not any(d.roles["decode"].panic for d in ds)
    assert {d.replicas["decode"] for d in ds} == {2}


def test_decode_sizes_on_streams_and_kv_blocks():
    sim = Sim(config(), decode=4)
    d = sim.run(8, decode={"running_streams": 40, "queue_depth": 20})[-1]  # 60 streams / 10 per replica
    assert d.replicas["decode"] == 6 and "x capacity" not in d.roles["decode"].reason
    # 3.6 replicas' worth of KV blocks in use, spread over whoever is ready; target 0.5 -> 7.2 replicas
    sim = Sim(config(), decode=4)
    ds = sim.run(30, decode=lambda n: {"running_streams": 4, "kv_utilisation": min(1.0, 3.6 / n)})
    assert "kv blocks" in ds[0].roles["decode"].reason
    assert ds[-1].replicas["decode"] == 8 and {d.replicas["decode"] for d in ds[-10:]} == {8}  # settles, no runaway


def test_long_queue_waits_veto_scale_down():
    sim = Sim(config(target_queue_wait_p99_s=1.0, scale_down_delay_s=0.0), prefill=4)
    ds = sim.run(20, prefill={"queue_wait_p99_s": 1.6, "queue_wait_p50_s": 0.4})
    assert {d.replicas["prefill"] for d in ds} == {4}
    assert ds[-1].roles["prefill"].reason == "queue wait p99 1.60s > 1s target: holding 4 (load wants 1)"
    assert sim.tick(prefill={"queue_wait_p99_s": 0.2}).replicas["prefill"] == 2  # waits back to normal: cut


def test_decide_is_pure():
    cfg = config()
    loads = {"prefill": RoleLoad(replicas=2, ready=2, queued_prompt_tokens=9000, t=1.0)}
    state = PolicyState()
    a, s1 = decide(PolicyContext(cfg, loads, 1.0), state)
    b, s2 = decide(PolicyContext(cfg, loads, 1.0), state)
    assert a == b and s1 == s2 and state == PolicyState()
    assert set(a.roles) == {"prefill"}  # a role not observed is not decided
    assert a.to_dict()["roles"]["prefill"]["replicas"] == a.replicas["prefill"]
    assert a.reason.startswith("prefill: ")


@pytest.mark.parametrize("kw", [
    {"tick_s": 0}, {"prefill_min_replicas": 3, "prefill_max_replicas": 2}, {"decode_max_replicas": 0},
    {"panic_window_s": 60.0}, {"panic_threshold": 1.0}, {"max_scale_down_fraction": 0.0},
    {"target_kv_utilisation": 1.5}, {"max_scale_down_step": -1}, {"prefill_min_replicas": -1},
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
