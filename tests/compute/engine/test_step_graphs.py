"""The decode step compiled ahead of time (compute/engine/step_graphs.py) on tiny int8 and int4 models: packages
built with AOTInductor for each range of batch sizes, loaded with the model's own tensors, run by the engine for
pure-decode batches (prefill stays eager) with the eager step's numbers within rounding; a second builder on the
same machine cache loads them and builds nothing."""

from __future__ import annotations

import os
import random

import pytest
import torch

from compute.engine.engine import Engine
from compute.engine.sampling import SamplingParams
from compute.engine.step_graphs import StepGraphs, ranges
from compute.modeling.batch import ForwardBatch
from compute.node.graph_builder import GraphBuilder
from tests.compute.tiny import int4_tiny, int8_tiny

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]  # compiles packages: make test-long
BS, STREAMS = 16, 4


@pytest.fixture(scope="module", params=["int8", "int4"])
def model(request):
    return int8_tiny() if request.param == "int8" else int4_tiny()


@pytest.fixture(scope="module")
def machine(tmp_path_factory, model):
    return str(tmp_path_factory.mktemp("machine-cache"))


def _engine(model, graphs: StepGraphs | None = None) -> Engine:
    e = Engine.for_model(model, num_blocks=96, block_size=BS, max_num_seqs=STREAMS, max_num_batched_tokens=64)
    e.runner.graphs = graphs
    return e


def _take(model, engine: Engine, cache_dir: str) -> tuple[StepGraphs, GraphBuilder]:
    graphs = StepGraphs()
    b = GraphBuilder(model, engine.runner.cache, STREAMS, cache_dir=cache_dir, model_key="int8",
                     plan_final=lambda t: True, install=graphs.install, name="tiny").start()  # fmt: skip
    try:
        assert b.wait_idle(400), "graphs not taken in 400 s"
    finally:
        assert b.stop()
    return graphs, b


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [rng.choices(range(3, 250), k=rng.randrange(3, 40)) for _ in range(n)]


@pytest.fixture(scope="module")
def built(model, machine):
    engine = _engine(model)
    graphs, b = _take(model, engine, machine)
    engine.runner.graphs = graphs
    return engine, graphs, b


def test_one_graph_per_range_of_equal_kernels_built_once(model, built, machine):
    engine, graphs, b = built
    assert ranges(model, STREAMS) == [(1, 1), (2, STREAMS)]  # size 1 alone (export takes it as a constant)
    assert [(g.lo, g.hi) for g in sorted(graphs.graphs, key=lambda g: g.lo)] == [(1, 1), (2, STREAMS)]
    assert sorted(b.sources.values()) == ["built", "built"]
    packages = [f for f in os.listdir(os.path.join(machine, "graphs")) if not f.startswith(".")]  # (.ID.lock files)
    assert sorted(packages) == sorted(f"{g}.pt2" for g in b.sources)
    assert b.state(graphs)["installed"] == [[1, 1], [2, STREAMS]] and b.state(graphs)["idle"]


def test_a_second_builder_on_the_machine_cache_loads_and_builds_nothing(model, built, machine):
    engine = _engine(model)
    graphs, b = _take(model, engine, machine)
    assert set(b.sources.values()) == {"local"} and set(b.sources) == set(built[2].sources)
    assert len(graphs.graphs) == 2


def test_graph_decode_step_equals_eager_within_rounding(model, built):
    """Teacher-forced: the same decode steps through the graph and eagerly, on two copies of one cache."""
    engine, graphs, _ = built
    ps = _prompts(3)
    tables = [list(range(1 + 4 * j, 5 + 4 * j)) for j in range(3)]
    caches = [engine.runner.cache, _engine(model).runner.cache]
    with torch.inference_mode():
        first = model(ForwardBatch.build(ps, [0] * 3, tables, BS), caches[1]).argmax(-1).tolist()
        caches[0].kv.copy_(caches[1].kv)
        tok, pos, agree, steps = first, [len(p) for p in ps], 0, 0
        for n in (3, 1, 2, 3):  # batch sizes through both graphs
            for _ in range(4):
                g = graphs.decode(tok[:n], pos[:n], tables[:n], caches[0])
                e = model(ForwardBatch.build([[t] for t in tok[:n]], pos[:n], tables[:n], BS), caches[1])
                assert g is not None and g.shape == e.shape and g.dtype == torch.float32
                assert (g - e).abs().max().item() < 0.05 * e.abs().max().item()  # rounding, not another function
                assert (caches[0].kv[:, :, :13].float() - caches[1].kv[:, :, :13].float()).abs().max() < 0.1
                agree, steps = agree + (g.argmax(-1) == e.argmax(-1)).sum().item(), steps + n
                tok = e.argmax(-1).tolist() + tok[n:]
                pos = [p + 1 for p in pos[:n]] + pos[n:]
    assert agree >= 0.9 * steps, (agree, steps)


def test_the_engine_runs_decodes_through_graphs_and_prefill_eagerly(model, built):
    engine, graphs, _ = built
    before = graphs.steps
    ps = _prompts(6)  # 6 requests, 4 at a time: batches of 4, 3, 2 and 1 decode, prefills mixed in (eager)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    out = engine.generate(ps, greedy)
    ref = _engine(model).generate(ps, greedy)
    assert graphs.steps - before >= 12 and all(len(o) == 12 for o in out)
    gaps = []  # each token the engine chose, scored by the eager model over the whole text: a near-maximum
    with torch.inference_mode():
        for p, o in zip(ps, out):
            cache = _engine(model).runner.cache
            full = model(ForwardBatch.build([p + o[:-1]], [0], [list(range(1, 6))], BS, all_logits=[True]), cache)
            rows = full[len(p) - 1 :]  # [12, V]: the logits each output token was chosen from
            chosen = rows.gather(1, torch.tensor(o)[:, None])[:, 0]
            gaps += ((rows.max(-1).values - chosen) / rows.abs().max(-1).values).tolist()
    assert max(gaps) < 0.02, max(gaps)  # within rounding of the best: the same function, summed in another order
    assert sum(a == b for a, b in zip(out, ref)) >= 3, (out, ref)  # most streams token for token



def test_a_killed_build_leaves_nothing_a_later_builder_keeps(tmp_path):
    import subprocess
    import sys

    from compute.node.graph_process import sweep

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f".0123456789abcdef.{int(dead.stdout)}.building.pt2", tmp_path / (
        f".0123456789abcdef.{os.getpid()}.building.pt2")  # fmt: skip
    for f in (stale, live, tmp_path / "0123456789abcdef.pt2"):
        f.write_bytes(b"x")
    sweep(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "0123456789abcdef.pt2"])


def _builders() -> list[int]:
    """Live processes below this one that a build started: the builder process and its compilers."""
    me, out = os.getpid(), []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and int(d) != me and _descends(int(d), me) and (
                "compute.node.graph_process" in cmd or any(c in cmd for c in ("cc1plus", "g++", " ld "))):
            out.append(int(d))
    return out


def _descends(pid: int, root: int) -> bool:
    for _ in range(64):  # bounded walk up the parents
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == root:
            return True
        if pid <= 1:
            return False
    return False


def test_stopping_mid_build_kills_the_builder_process_group(tmp_path):
    """The build runs in a process of its own (compute/node/graph_process.py), its own process group in the node's
    session (one scheduler autogroup: a session of its own would be weighted as much as the node's whatever its
    policy), under SCHED_IDLE: a stop kills the group at once, builder and compilers, and nothing half-built is
    installed or left under its name."""
    import time

    model = int8_tiny()
    engine = _engine(model)
    graphs = StepGraphs()
    b = GraphBuilder(model, engine.runner.cache, STREAMS, cache_dir=str(tmp_path), model_key="int8",
                     plan_final=lambda t: True, install=graphs.install, name="tiny").start()  # fmt: skip
    deadline = time.monotonic() + 120
    while b._child is None and time.monotonic() < deadline:  # the build reaches its builder process
        time.sleep(0.05)
    child = b._child
    assert child is not None, "no builder process in 120 s"
    assert os.getpgid(child.pid) == child.pid != os.getpgid(0)  # a process group of its own
    assert os.getsid(child.pid) == os.getsid(0)  # the node's session: its autogroup
    time.sleep(3)  # into the trace / the compiler
    with open(f"/proc/{child.pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[38]) == os.SCHED_IDLE  # field 41, policy
    t0 = time.monotonic()
    assert b.stop(timeout=30) and not graphs.graphs  # the thread ends; nothing half-built was installed
    assert time.monotonic() - t0 < 5 and child.poll() is not None
    deadline = time.monotonic() + 10
    while _builders() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _builders()
    assert not [p for p in (tmp_path / "graphs").iterdir() if p.suffix == ".pt2"]


def test_a_failing_graph_is_dropped_and_the_step_runs_eagerly(model):
    from compute.engine.step_graphs import Graph

    def broken(*args):
        raise RuntimeError("a shape the package does not take")

    graphs = StepGraphs()
    graphs.install(Graph(1, STREAMS, 256, None, broken, "0123456789abcdef"))
    engine = _engine(model, graphs)
    out = engine.generate(_prompts(2), SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o) == 4 for o in out) and graphs.graphs == [] and graphs.steps == 0
    assert out == _engine(model).generate(_prompts(2), SamplingParams(max_tokens=4, temperature=0))


def test_two_builders_on_one_machine_build_each_package_once(tmp_path):
    """Two nodes of one machine (here two builders of one process: a lock per package beside it) start together:
    each package is built by one of them, and the other takes it from the machine's cache."""
    model = int8_tiny()
    graphs, builders = [StepGraphs(), StepGraphs()], []
    for g in graphs:
        builders.append(GraphBuilder(model, _engine(model).runner.cache, STREAMS, cache_dir=str(tmp_path),
                                     model_key="int8", plan_final=lambda t: True, install=g.install,
                                     name="tiny").start())  # fmt: skip
    try:
        assert all(b.wait_idle(400) for b in builders)
    finally:
        assert all(b.stop() for b in builders)
    a, b = (bl.sources for bl in builders)
    assert set(a) == set(b) and len(a) == 2 and all(sorted((a[g], b[g])) == ["built", "local"] for g in a), (a, b)
    assert all(len(g.graphs) == 2 for g in graphs)
