"""Placement (autoscaler/placement.py): the warm pool's ranking and settings, pure — no process, no HTTP.

- rank: a runtime whose node cache holds the model wins, then a standby one, then one with memory room,
  then one with an idle model to evict; a runtime that holds the model, is draining, is not up, or is
  full of busy models is no candidate; evicting a model still wanted ranks last, a kept one never.
- PoolConfig is checked; pool_config floors the runtimes at the plan (or min_replicas) and caps them at
  max_replicas.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoscaler.placement import PoolConfig, Runtime, pool_config, rank
from compute.node.protocol import ModelLoad

GIB = 2**30


def _rt(url, models=None, cached=None, budget=4 * GIB, used=0, role="decode", up=True, state=None):
    models = {m: ModelLoad(model=m, state=s, active_requests=a, bytes=GIB) for m, (s, a) in (models or {}).items()}
    return Runtime(role, url, up=up, reachable=up, state=state or ("ready" if models else "standby"),
                   models=models, budget=budget, used=used, cached=cached or {})  # fmt: skip


def test_rank_prefers_cached_shards_then_standby_then_room_then_an_idle_model_to_evict():
    rts = [
        _rt("http://evict", {"b": ("ready", 0)}, used=4 * GIB),  # full, but b is idle
        _rt("http://room", {"b": ("ready", 3)}, used=GIB),  # busy model, room for one more
        _rt("http://standby"),
        _rt("http://cached", {"c": ("ready", 1)}, cached={"m": 1.0}, used=GIB),
        _rt("http://full-busy", {"b": ("ready", 2)}, used=4 * GIB),  # nothing to evict, no room: not a candidate
        _rt("http://holds", {"m": ("loading", 0)}),  # holds m already
        _rt("http://draining", state="draining"),
        _rt("http://starting", up=False),
        _rt("http://prefill", role="prefill"),
    ]
    got = [(rt.url, why) for rt, why in rank(rts, "m", "decode", need_bytes=GIB)]
    assert [u for u, _ in got] == ["http://cached", "http://standby", "http://room", "http://evict"], got
    assert "100%" in got[0][1] and got[1][1] == "standby runtime" and "GiB free" in got[2][1]
    assert got[3][1] == "evicts an idle model (b)"
    # a partly cached runtime still beats a standby one; among equals, the URL decides (stable)
    partly = _rt("http://partly", cached={"m": 0.25})
    assert [rt.url for rt, _ in rank([_rt("http://s2"), partly, _rt("http://s1")], "m", "decode")] == [
        "http://partly", "http://s1", "http://s2"]  # fmt: skip
    # room is measured against the model's size once some runtime has reported it
    assert [rt.url for rt, _ in rank([_rt("http://r", {"b": ("ready", 1)}, used=3 * GIB)], "m", "decode",
                                     need_bytes=2 * GIB)] == []  # fmt: skip


def test_pool_config_is_checked():
    with pytest.raises(ValueError):
        PoolConfig(pool_size=-1)
    with pytest.raises(ValueError):
        PoolConfig(max_runtimes={"decode": 0})
    assert PoolConfig(max_runtimes={"decode": 3}).cap("decode") == 3 and PoolConfig().cap("prefill") == 8
    with pytest.raises(ValueError):
        PoolConfig(min_runtimes={"decode": -1})
    assert PoolConfig(max_runtimes={"decode": 1}, min_runtimes={"decode": 2}).cap("decode") == 2  # the floor wins


def test_pool_config_floors_runtimes_at_the_plan_and_caps_them_at_max_replicas():
    from autoscaler.config import AutoscalerConfig

    auto = AutoscalerConfig(prefill_min_replicas=0, prefill_max_replicas=1, decode_min_replicas=0,
                            decode_max_replicas=3, pool_size=1)  # fmt: skip
    cfg = pool_config(auto, ("prefill", "decode"), floors={"prefill": 1, "decode": 1})  # pdserve up 1 + 1
    assert (cfg.floor("prefill"), cfg.cap("prefill"), cfg.floor("decode"), cfg.cap("decode")) == (1, 1, 1, 3)
    cfg = pool_config(dataclasses.replace(auto, decode_min_replicas=2), ("prefill", "decode"))  # pdserve autoscale
    assert (cfg.floor("prefill"), cfg.floor("decode"), cfg.cap("decode")) == (0, 2, 3)
    fixed = dataclasses.replace(auto, prefill_min_replicas=2, prefill_max_replicas=2)  # pdserve up --prefill 2
    cfg = pool_config(fixed, ("prefill", "decode"), floors={"prefill": 2, "decode": 1})
    assert (cfg.floor("prefill"), cfg.cap("prefill")) == (2, 3)  # its standby on top: a dead node is replaced by a claim


def test_a_claim_ranks_evicting_a_wanted_model_last_and_never_evicts_a_kept_one():
    full = {"used": 4 * GIB}
    rts = [_rt("http://wanted", {"w": ("ready", 0)}, **full), _rt("http://unwanted", {"u": ("ready", 0)}, **full)]
    assert [rt.url for rt, _ in rank(rts, "m", "decode", GIB, wanted={"w"})] == ["http://unwanted", "http://wanted"]
    got = rank(rts, "m", "decode", GIB, wanted={"w"}, keep={"http://wanted": {"w"}})
    assert [rt.url for rt, _ in got] == ["http://unwanted"]  # kept: no candidate (the node would refuse it too)


def test_the_pool_module_still_exports_the_placement_names():
    from autoscaler import pool

    assert (pool.PoolConfig, pool.Runtime, pool.rank, pool.pool_config) == (PoolConfig, Runtime, rank, pool_config)
