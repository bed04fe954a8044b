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
