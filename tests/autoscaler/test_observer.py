"""The observer's pure part: a gateway status snapshot (gateway/routes/internal.py) -> RoleLoad per (model, role)."""

from __future__ import annotations

import msgspec
import pytest

from autoscaler.actuator import NodeInfo
from autoscaler.loop import TickReport
from autoscaler.observer import loads_from_status, merge_status, report_body
from autoscaler.policy import Decision, RoleDecision
from gateway.api.status import read as read_status


def held(state="ready", max_streams=None, prefill_tps=None, **fields):
    """One entry of a node's /load "models" (contract A)."""
    cap = {"tpot_target_s": 0.1, "decode_step_s": None, "max_streams": max_streams, "decode_tokens_per_s": None,
           "prefill_tokens_per_s": prefill_tps, "samples": 0 if max_streams is None else 40}  # fmt: skip
    return {"state": state, "ref": "x@v1", "weights": "int8", "bytes": 1, "weights_bytes": 1, "kv_bytes": 0,
            "last_used": None, "active_requests": 0, "queued": 0, "running": 0, "importing": 0,
            "queued_prompt_tokens": 0, "kv_blocks_used": 0, "kv_blocks_free": 100, "kv_blocks_total": 100,
            "kv_transfers_held": 0, "progress": {}, "error": None, "capacity": cap, **fields}  # fmt: skip


def runtime(url, role, registry_state="ready", **models):
    """A node entry whose /load is the multi-model shape: state standby when it holds nothing."""
    state = "ready" if any(m["state"] == "ready" for m in models.values()) else ("loading" if models else "standby")
    first = next((n for n, m in models.items() if m["state"] == "ready"), None)
    load = {"role": role, "state": state, "ready": state == "ready", "draining": False, "model": first,
            "models": models, "memory_budget_bytes": 1 << 30, "memory_used_bytes": 0, "cached": {}}  # fmt: skip
    return {"url": url, "role": role, "state": registry_state, "source": "autoscaler", "load": load}


def gw_model(**kw):
    return {"queue_depth": 0, "held": 0, "running": 0, "queue_wait_p99_s": 0.0, "ttft_p99_s": 0.0,
            "tpot_p99_s": 0.0, "requests": 0, "last_request_t": None, "idle_s": 0.0, **kw}  # fmt: skip


# two models on a pool: smollm2 on two prefill runtimes and two decode runtimes (one of them loading it),
# big only on a decode runtime that is draining it; two standby runtimes holding nothing; one runtime
# that stopped answering (its load is stale)
SNAP = {"t": 1.0, "queue_depth": 7, "running": 9, "queue_wait_p99_s": 0.4, "nodes": [
    runtime("http://p1", "prefill", smollm2=held(queued_prompt_tokens=900, queued=2, prefill_tps=1200.0)),
    runtime("http://p2", "prefill", smollm2=held(queued_prompt_tokens=300, prefill_tps=800.0)),
    runtime("http://p3", "prefill"),  # standby
    runtime("http://d1", "decode", smollm2=held(running=6, queued=1, kv_blocks_used=30, max_streams=12),
            big=held("draining", running=2)),
    runtime("http://d2", "decode", smollm2=held("loading", progress={"fraction": 0.4})),
    runtime("http://d3", "decode"),  # standby
    runtime("http://d4", "decode", "unhealthy", smollm2=held(running=50, kv_blocks_used=99, max_streams=90)),
], "models": {
    "smollm2": gw_model(queue_depth=4, held=0, running=8, queue_wait_p99_s=0.7, ttft_p99_s=1.9, tpot_p99_s=0.12,
                        requests=120, last_request_t=1.0, idle_s=0.5),
    "big": gw_model(queue_depth=3, held=3, idle_s=0.0),  # nobody holds it ready: its requests are held
    "tiny": gw_model(idle_s=400.0),  # served, never asked for, held by no node
}, "autoscaler": None}  # fmt: skip


def test_loads_from_status_per_model_and_role_on_a_realistic_snapshot():
    loads = loads_from_status(SNAP)
    assert set(loads) == {(m, r) for m in ("smollm2", "big", "tiny") for r in ("prefill", "decode")}
    p, d = loads[("smollm2", "prefill")], loads[("smollm2", "decode")]
    assert (p.model, p.replicas, p.ready, p.starting) == ("smollm2", 2, 2, 0)  # the standby p3 holds nothing
    assert (p.queued_prompt_tokens, p.node_queued, p.prefill_tokens_per_s) == (1200, 2, 1000.0)  # mean of 1200, 800
    # d1 ready, d2 loading it, d4 unhealthy: a replica whose stale load is not summed
    assert (d.replicas, d.ready, d.starting) == (3, 1, 1)
    assert (d.running_streams, d.node_queued, d.capacity_streams, d.kv_utilisation) == (6, 1, 12.0, 0.15)
    for x in (p, d):  # the gateway's per-model signals, on both roles
        assert (x.queue_depth, x.held, x.queue_wait_p99_s, x.ttft_p99_s, x.tpot_p99_s, x.idle_s) == (
            4, 0, 0.7, 1.9, 0.12, 0.5)  # fmt: skip
    b = loads[("big", "decode")]
    assert (b.replicas, b.ready, b.running_streams, b.held, b.queue_depth) == (0, 0, 0, 3, 3)  # draining: leaving
    t = loads[("tiny", "prefill")]
    assert (t.replicas, t.idle_s, t.capacity_streams, t.prefill_tokens_per_s) == (0, 400.0, None, None)


def test_nothing_measured_yet_gives_none_and_roles_can_be_restricted():
    snap = {"nodes": [runtime("http://d1", "decode", m=held())], "models": {"m": gw_model()}}
    d = loads_from_status(snap)[("m", "decode")]
    assert (d.capacity_streams, d.prefill_tokens_per_s, d.ready) == (None, None, 1)
    assert set(loads_from_status(snap, roles=("decode",))) == {("m", "decode")}
    assert loads_from_status({"nodes": []}) == {}  # no model named anywhere: nothing to size
    empty = loads_from_status({"models": {"m": gw_model()}, "nodes": [runtime("http://d1", "decode")]})
    assert empty[("m", "decode")].kv_utilisation == 0.0 and empty[("m", "decode")].replicas == 0  # no division by 0


def test_merge_status_of_gateway_replicas():
    other = {"queue_depth": 2, "running": 1, "queue_wait_p99_s": 1.5, "nodes": [
        runtime("http://d4", "decode", smollm2=held(running=1, max_streams=8)),  # this gateway still reaches d4
        runtime("http://d5", "decode", big=held(running=1)),
    ], "models": {"smollm2": gw_model(queue_depth=1, held=0, ttft_p99_s=3.0, requests=5, last_request_t=2.0,
                                      idle_s=0.1),
                  "big": gw_model(queue_depth=1, held=1, idle_s=9.0)}}  # fmt: skip
    m = merge_status([SNAP, other])
    assert (m.queue_depth, m.running, m.queue_wait_p99_s, m.gateways) == (9, 10, 1.5, 2)
    by_url = {n.url: n for n in m.nodes}
    assert len(by_url) == 8 and by_url["http://d4"].state == "ready"
    s = m.models["smollm2"]
    assert (s.queue_depth, s.requests, s.ttft_p99_s, s.tpot_p99_s, s.idle_s, s.last_request_t) == (
        5, 125, 3.0, 0.12, 0.1, 2.0)  # fmt: skip
    assert (m.models["big"].held, m.models["big"].idle_s, m.models["tiny"].idle_s) == (4, 0.0, 400.0)
    assert read_status(SNAP).models["smollm2"].requests == 120  # the merge copied, never changed, its inputs
    loads = loads_from_status(m)
    assert loads[("smollm2", "decode")].running_streams == 7 and loads[("smollm2", "decode")].capacity_streams == 10.0
    assert loads[("big", "decode")].ready == 1


def test_a_status_that_is_not_one_is_refused_naming_the_field():
    with pytest.raises(msgspec.ValidationError, match=r"nodes\[0\].load.models"):
        loads_from_status({"nodes": [{"url": "http://d1", "role": "decode", "load": {"models": ["m"]}}]})
    with pytest.raises(msgspec.ValidationError, match="url"):
        loads_from_status({"nodes": [{"role": "decode"}]})


def test_report_body_writes_keys_as_model_slash_role():
    d = Decision(t=5.0, roles={("m", "decode"): RoleDecision(role="decode", model="m", replicas=2, current=1,
                                                              reason="panic: 6s load 3.0x capacity")})  # fmt: skip
    report = TickReport(t=5.0, decision=d, asked={("m", "decode"): 2})
    nodes = {("m", "decode"): [NodeInfo(role="decode", url="http://d1", ready=True)]}
    body = report_body(report, nodes, "local")
    assert body["asked"] == {"m/decode": 2} and list(body["nodes"]) == ["m/decode"]
    assert body["decision"]["roles"]["m/decode"]["model"] == "m" and body["reason"].startswith("m/decode: panic")
    assert body["nodes"]["m/decode"][0]["url"] == "http://d1"


def test_arrival_rates_and_decode_throughput_at_the_slo_batch():
    def dec(**cap):
        e = held(max_streams=cap.pop("max_streams", None))
        e["capacity"].update(cap)
        return e

    snap = {"nodes": [
        runtime("http://d1", "decode", m=dec(max_streams=7, decode_step_s={"a": 0.043, "b": 0.0079},
                                             decode_tokens_per_s=20.0)),  # at 7 streams: 7 / 0.0983 s
        runtime("http://d2", "decode", m=dec(decode_tokens_per_s=30.0)),  # no fit yet: what it measured
        runtime("http://d3", "decode", m=dec()),  # nothing measured: left out of the mean
    ], "models": {"m": gw_model(requests_per_s=9.5, prompt_tokens_per_s=380.0, output_tokens_per_s=152.0)}}  # fmt: skip
    loads = loads_from_status(snap)
    d, p = loads[("m", "decode")], loads[("m", "prefill")]
    assert abs(d.decode_tokens_per_s - (7 / (0.043 + 0.0079 * 7) + 30.0) / 2) < 1e-6
    for x in (p, d):
        assert (x.requests_per_s, x.prompt_tokens_per_s, x.output_tokens_per_s) == (9.5, 380.0, 152.0)
    assert p.decode_tokens_per_s is None
    # an old gateway (no rates): 0.0, the demand signal reads no demand
    assert loads_from_status({"models": {"m": gw_model()}, "nodes": []})[("m", "prefill")].prompt_tokens_per_s == 0.0
    # two gateways: their arrivals add up
    m = merge_status([snap, {"nodes": [], "models": {"m": gw_model(requests_per_s=0.5, prompt_tokens_per_s=20.0)}}])
    assert (m.models["m"].requests_per_s, m.models["m"].prompt_tokens_per_s) == (10.0, 400.0)
