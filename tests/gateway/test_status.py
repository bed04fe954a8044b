"""`pdserve status`'s lines for the autoscaler's capacity bounds (gateway/status.py): which bound held a
scale-up back, and whether it is full."""

from __future__ import annotations

from gateway.status import capacity_lines


def test_each_bound_is_one_line_saying_whether_it_held():
    report = {"capacity": [
        {"kind": "machine", "limit": 2, "serving": 2, "why": "machine: 2 cores, 1 thread per node → at most 2 serving nodes"},
        {"kind": "schedulable", "limit": 3, "serving": 1, "roles": ["decode"],
         "why": "schedulable: 3 decode pods placed, 1 pending 12s → at most 3 serving decode nodes"},
    ]}  # fmt: skip
    assert capacity_lines(report) == [
        "  capacity: machine: 2 cores, 1 thread per node → at most 2 serving nodes; 2 serving now: held at the bound",
        "  capacity: schedulable: 3 decode pods placed, 1 pending 12s → at most 3 serving decode nodes; 1 serving now",
    ]
    assert capacity_lines({}) == [] and capacity_lines({"capacity": None}) == []


def test_each_node_line_shows_its_prefix_cache_hit_rate():
    from gateway.status import render

    load = {"running": 1, "queued_prompt_tokens": 0, "kv_blocks_used": 3, "kv_blocks_total": 64,
            "prefix_queries": 400, "prefix_hits": 300}  # fmt: skip
    st = {"running": 0, "queue_depth": 0, "served": ["m"],
          "nodes": [{"role": "both", "url": "http://n1", "state": "ready", "models": {"m": "ready"},
                     "load": {"models": {"m": load}}},
                    {"role": "both", "url": "http://n2", "state": "ready", "models": {"m": "ready"},
                     "load": {"models": {"m": {"prefix_queries": 0}}}}]}  # fmt: skip
    lines = render(st)
    header = next(line for line in lines if "PREFIX_HIT" in line)
    n1, n2 = (next(line for line in lines if url in line) for url in ("http://n1", "http://n2"))
    assert n1.rstrip().endswith("75.0%") and n2.rstrip().endswith("-")
    assert header.index("PREFIX_HIT") + len("PREFIX_HIT") == len(n1.rstrip())
