"""The observer's pure part: a gateway status snapshot (gateway/internal.py) -> RoleLoad per role."""

from __future__ import annotations

from autoscaler.observer import loads_from_status, merge_status


def node(url, role, state="ready", **load):
    return {"url": url, "role": role, "state": state, "source": "autoscaler", "load": load}


SNAP = {"queue_depth": 3, "running": 5, "queue_wait_p99_s": 0.7, "nodes": [
    node("http://p1", "prefill", queued_prompt_tokens=900),
    node("http://p2", "prefill", "unhealthy", queued_prompt_tokens=5000),  # not answering: its load is stale
    node("http://d1", "decode", running=4, kv_blocks_used=30, kv_blocks_total=100),
    node("http://d2", "decode", "loading", running=0, kv_blocks_used=0, kv_blocks_total=100),
]}  # fmt: skip


def test_loads_from_status_sums_healthy_nodes_per_role():
    loads = loads_from_status(SNAP)
    p, d = loads["prefill"], loads["decode"]
    assert (p.replicas, p.ready, p.queued_prompt_tokens, p.queue_depth, p.queue_wait_p99_s) == (2, 1, 900, 3, 0.7)
    assert (d.replicas, d.ready, d.running_streams, d.kv_utilisation) == (2, 2, 4, 0.15)
    assert loads_from_status({"nodes": []})["decode"].kv_utilisation == 0.0  # no nodes: no division by zero


def test_merge_status_of_gateway_replicas():
    other = {"queue_depth": 2, "running": 1, "queue_wait_p99_s": 1.5,
             "nodes": [node("http://p2", "prefill", queued_prompt_tokens=10), node("http://d3", "decode", running=1)]}
    m = merge_status([SNAP, other])
    assert (m["queue_depth"], m["running"], m["queue_wait_p99_s"], m["gateways"]) == (5, 6, 1.5, 2)
    by_url = {n["url"]: n for n in m["nodes"]}
    assert len(by_url) == 5 and by_url["http://p2"]["state"] == "ready"  # one gateway still reaches it
    assert loads_from_status(m)["decode"].running_streams == 5
