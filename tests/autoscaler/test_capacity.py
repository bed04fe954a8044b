"""The capacity bound (autoscaler/capacity.py) and the policy's stage 6: never more serving nodes than the
machine (cores, memory) or the cluster can run; the decision line says which bound held a scale-up back."""

from __future__ import annotations

import os

import pytest

from autoscaler.capacity import CapacityBound, CpuMeter, Machine, machine, machine_bound
from tests.autoscaler.policy_cases import D, P, Sim, config, rep, streams, tokens

GIB = 2**30


def two_cores(replicas: dict) -> tuple[CapacityBound, ...]:
    """A 2-core machine, 1 thread per node, nothing measured yet: at most 2 serving nodes."""
    return (machine_bound(Machine(cores=2.0, memory_bytes=16 * GIB), 1, sum(replicas.values())),)


def test_static_bound_names_cores_threads_and_nodes():
    b = machine_bound(Machine(cores=2.0, memory_bytes=16 * GIB), 1, serving=2)
    assert (b.kind, b.limit, b.room) == ("machine", 2, 0)
    assert b.why == "machine: 2 cores, 1 thread per node → at most 2 serving nodes"
    b = machine_bound(Machine(cores=8.0, memory_bytes=16 * GIB), 2, serving=1)
    assert (b.limit, b.room) == (4, 3) and "2 threads per node → at most 4" in b.why
    assert machine_bound(Machine(cores=0.5, memory_bytes=GIB), 1, serving=0).limit == 1  # one node always


@pytest.mark.parametrize("busy, limit", [(1.9, 2), (1.5, 3), (1.0, 3), (0.2, 4), (0.0, 4)])
def test_measured_idle_cores_allow_a_node_where_half_its_core_is_idle(busy, limit):
    b = machine_bound(Machine(cores=2.0, memory_bytes=16 * GIB), 1, serving=2, busy=busy)
    assert b.limit == limit  # never past 2 x cores / threads (each node at >= half its cores)
    assert f"{busy:.1f} busy" in b.why


def test_a_busy_moment_never_cuts_what_runs_at_full_speed():
    b = machine_bound(Machine(cores=4.0, memory_bytes=16 * GIB), 1, serving=3, busy=4.0)
    assert b.limit == 4 and b.room == 1
    b = machine_bound(Machine(cores=2.0, memory_bytes=16 * GIB), 1, serving=1, busy=1.9)  # a refill's imports
    assert b.limit == 2 and b.room == 1


def test_memory_bounds_when_it_is_the_smaller():
    b = machine_bound(Machine(cores=16.0, memory_bytes=2 * GIB), 1, serving=2, node_bytes=GIB // 2)
    assert (b.kind, b.limit) == ("memory", 5)  # 2 + 0.9 x 2 GiB / 0.5 GiB
    assert b.why.startswith("memory: 2.0 GiB available, 0.50 GiB per node → at most 5 serving nodes")


def test_machine_reads_affinity_and_the_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "memory.max").write_text(str(4 * GIB))
    (tmp_path / "memory.current").write_text(str(GIB))
    m = machine(str(tmp_path), "/proc/meminfo")
    assert m.cores == min(1.5, len(os.sched_getaffinity(0))) and m.memory_bytes <= 3 * GIB
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max")
    assert machine(str(tmp_path)).cores == len(os.sched_getaffinity(0))


def test_cpu_meter_measures_the_machine(tmp_path):
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0))

    def write(busy: int, idle: int) -> None:  # jiffies per CPU of the affinity mask (and one outside it)
        rows = [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c in cpus] + [f"cpu{max(cpus) + 1} 999999 0 0 0 0 0 0 0"]
        stat.write_text("cpu  1 2 3 4 5 6 7 8 0 0\n" + "\n".join(rows) + "\n")

    meter = CpuMeter(window_s=1.0, stat=str(stat))
    write(0, 0)
    assert meter.sample(now=0.0) is None
    from autoscaler.capacity import CLK_TCK

    write(CLK_TCK // 2, CLK_TCK // 2)  # each CPU half busy over 1 s
    assert meter.sample(now=1.0) == pytest.approx(0.5 * len(cpus))
    assert CpuMeter().sample() is None and CpuMeter(window_s=0.0).sample() is None  # the real /proc/stat reads


# --- the policy's stage 6 ---------------------------------------------------------------------


def test_a_burst_never_plans_more_serving_nodes_than_the_machine_runs():
    sim = Sim(config(), prefill=1, decode=1, capacity=two_cores)
    ds = sim.run(10, prefill=tokens(15000), decode=streams(60, capacity=10.0))
    assert all(sum(d.replicas.values()) <= 2 for d in ds)
    assert ds[-1].roles[P].reason.startswith("bounds: machine: 2 cores, 1 thread per node → at most 2 serving "
                                             "nodes (load wants ")  # fmt: skip
    assert "panic" in ds[-1].roles[P].reason  # what the load wanted, and why, stays in the line
    assert ds[-1].roles[P].replicas == 1 and ds[-1].roles[D].replicas == 1


def test_room_goes_to_the_most_loaded_key_first():
    bound = lambda r: (CapacityBound("machine", limit=3, serving=sum(r.values()), why="machine: test"),)  # noqa: E731
    sim = Sim(config(), prefill=1, decode=1, capacity=bound)
    d = sim.tick(prefill=tokens(3000), decode=streams(80, capacity=10.0))  # decode: 8x, prefill: 3x
    assert rep(d) == {"prefill": 1, "decode": 2}
    assert d.roles[P].reason.startswith("bounds: machine: test (load wants ")
    d = sim.tick(prefill=tokens(3000), decode=streams(80, capacity=10.0))
    assert rep(d) == {"prefill": 1, "decode": 2}  # full: nothing more, and the panic peak is not the unbounded one


def test_a_bound_that_loosens_lets_the_burst_grow_and_scale_down_is_never_held():
    limit = {"n": 2}
    bound = lambda r: (CapacityBound("machine", limit["n"], sum(r.values()), "machine: test"),)  # noqa: E731
    sim = Sim(config(), prefill=1, decode=1, capacity=bound)
    sim.run(3, prefill=tokens(5000))
    assert sim.of() == {"prefill": 1, "decode": 1}
    limit["n"] = 4
    sim.run(1, prefill=tokens(5000))
    assert sim.of()["prefill"] == 3  # room for 2 more
    limit["n"] = 1  # the machine got busy: nothing is cut by the bound, scale-down stays the policy's
    d = sim.tick(prefill=tokens(5000))
    assert rep(d)["prefill"] == 3


def test_a_role_bound_covers_only_its_role_and_activation_is_never_held():
    bound = lambda r: (CapacityBound("schedulable", limit=1, serving=r[D], why="schedulable: 1 decode pod",  # noqa: E731
                                     roles=("decode",)),)  # fmt: skip
    sim = Sim(config(), prefill=1, decode=1, capacity=bound)
    d = sim.tick(prefill=tokens(5000), decode=streams(60, capacity=10.0))
    assert rep(d)["decode"] == 1 and rep(d)["prefill"] > 1
    assert d.roles[D].reason.startswith("bounds: schedulable: 1 decode pod")
    full = lambda r: (CapacityBound("machine", limit=0, serving=5, why="machine: full"),)  # noqa: E731
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0), prefill=0, decode=0, capacity=full)
    d = sim.tick(prefill={"held": 1, "queue_depth": 1}, decode={"held": 1, "queue_depth": 1})
    assert rep(d) == {"prefill": 1, "decode": 1} and d.roles[P].activation


def test_a_model_woken_from_zero_takes_the_room_before_a_burst_of_another():
    B_P, B_D = ("b", "prefill"), ("b", "decode")
    bound = lambda r: (CapacityBound("machine", limit=sum(r.values()) + 2, serving=sum(r.values()),  # noqa: E731
                                     why="machine: test"),)  # fmt: skip
    sim = Sim(config(prefill_min_replicas=0, decode_min_replicas=0), prefill=1, decode=1, capacity=bound,
              b__prefill=0, b__decode=0)  # fmt: skip
    d = sim.step({P: tokens(5000), D: streams(5, capacity=10.0), B_P: {"held": 1, "queue_depth": 1},
                  B_D: {"held": 1, "queue_depth": 1}})  # fmt: skip
    assert rep(d, "b") == {"prefill": 1, "decode": 1} and rep(d)["prefill"] == 1  # the room went to the wake
    assert d.roles[P].reason.startswith("bounds: machine: test (load wants ")
