"""``[node] step = graph`` across real node processes: a node on a machine class with no packages serves eagerly
at once, builds its compiled decode steps after ready, publishes them and runs decodes through them; a node started
later on an empty machine cache takes every package from the store and compiles nothing (its load log and /load);
SIGTERM leaves no process behind (the compiler's included)."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest

from compute.node.launcher import Services
from paramstore import ParamStore, StoreConfig
from tests.services import TOKEN, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]  # compiles packages: make test-long
SEQS = 4


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory, tiny_hf):
    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("graphs-store")), k=2, m=1)
    with ParamStore(cfg) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="int8")
    return cfg


def _graphs(node) -> dict:
    return node.load()["models"]["tiny"]["graphs"]


def _settled(node) -> bool:
    """Every package taken and handed to the engine thread, which installs it between two steps."""
    g = _graphs(node)
    return g["idle"] and len(g["installed"]) == len(g["sources"])


def _generate(node, rid: str) -> list[int]:
    body = {"request_id": rid, "prompt_token_ids": [1, 2, 3, 4, 5], "params": {"max_tokens": 8, "temperature": 0}}
    r = httpx.post(node.url + "/internal/generate", json=body, auth=node.auth, timeout=60)
    assert r.status_code == 200, r.text
    return [t for line in r.text.splitlines() for t in json.loads(line)["token_ids"]]


def _descendants(node) -> list[psutil.Process]:
    try:
        return psutil.Process(node.p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_node_builds_publishes_and_a_later_node_loads_from_the_store(tmp_path, int8_store):
    svc = Services(int8_store.locations, "tiny", str(tmp_path), TOKEN)
    try:
        flags = ("--step", "graph", "--max-num-seqs", str(SEQS), "--log-level", "info")
        first = svc.node("both", kv_blocks=64, extra=(*flags, "--cache-dir", str(tmp_path / "machine-a")))
        first.wait_ready(120)
        eager = _generate(first, "before")  # ready before any graph: served eagerly at once
        assert len(eager) == 8
        wait_for(lambda: _settled(first), 400, "the first node's graphs", every=1)
        g = _graphs(first)
        assert g["installed"] and g["installed"][0] == [1, 1] and g["installed"][-1][1] == SEQS, g
        assert set(g["sources"].values()) == {"built"}
        with ParamStore(int8_store) as store:
            assert {r["id"] for r in store.graphs.list() if r["valid"]} == set(g["sources"])
        steps = g["steps"]
        assert len(_generate(first, "after")) == 8 and _graphs(first)["steps"] >= steps + 7  # decodes via a graph
        assert "building it" in first.log() and "published to the store" in first.log()

        later = svc.node("both", kv_blocks=64, extra=(*flags, "--cache-dir", str(tmp_path / "machine-b")))
        later.wait_ready(120)
        wait_for(lambda: _settled(later), 120, "the later node's graphs", every=0.5)
        g2 = _graphs(later)
        assert g2["sources"] == dict.fromkeys(g["sources"], "store") and g2["installed"] == g["installed"]
        assert "building it" not in later.log() and "from the store" in later.log()  # the load log: no compile
        assert len(_generate(later, "later")) == 8 and _graphs(later)["steps"] >= 7
        procs = [p for n in (first, later) for p in [psutil.Process(n.p.pid), *_descendants(n)]]
    finally:
        svc.stop_all()
    gone, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_step_is_auto_by_default_graph_by_flag_file_or_env_and_refused_under_invariant(tmp_path):
    from compute.node.config import NodeConfig
    from tests.cli import PDSERVE, resolved, run

    node, token = PDSERVE + ["node", "--role", "both", "--model", "m"], {"PDSERVE_INTERNAL_TOKEN": "t"}
    assert resolved(node, token)["step"] == "auto"  # (the suite's own $PDSERVE_STEP=eager is not passed here)
    assert resolved(node + ["--step", "graph"], token)["step"] == "graph"
    assert resolved(node, {**token, "PDSERVE_STEP": "eager"})["step"] == "eager"
    path = tmp_path / "pdserve.toml"
    path.write_text('[node]\nstep = "graph"\n')
    assert resolved(node + ["--config", str(path)], token)["step"] == "graph"
    assert resolved(node + ["--config", str(path), "--step", "eager"], token)["step"] == "eager"
    for bad in (["--step", "graph", "--kernels", "invariant"], ["--config", str(path), "--device", "mps"]):
        r = run(node + [*bad, "--print-config"], token)
        assert r.returncode == 2 and "step = graph" in r.stderr and "Traceback" not in r.stderr, r.stderr
    auto = {"role": "both", "internal_token": "t"}
    assert NodeConfig(**auto).compiled_step and not NodeConfig(**auto, kernels="invariant").compiled_step
    assert not NodeConfig(**{**auto, "role": "prefill"}).compiled_step  # a prefill node decodes nothing
    assert not NodeConfig(**auto, step="eager").compiled_step
    path.write_text('[node]\nstep = "compiled"\n')
    r = run(node + ["--config", str(path), "--print-config"], token)
    assert r.returncode == 2 and "invalid step 'compiled'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sigterm_mid_build_closes_the_node_and_leaves_no_compiler(tmp_path, int8_store):
    import signal
    import time

    with ParamStore(int8_store) as store:  # none in the store: this node builds
        for row in store.graphs.list():
            store.graphs.delete(row["id"])
    svc = Services(int8_store.locations, "tiny", str(tmp_path), TOKEN)
    try:
        node = svc.node("both", kv_blocks=64, extra=("--step", "graph", "--max-num-seqs", str(SEQS), "--log-level",
                                                     "info", "--cache-dir", str(tmp_path / "machine")))  # fmt: skip
        node.wait_ready(120)
        wait_for(lambda: "building it" in node.log(), 120, "a build", every=0.2)
        time.sleep(2)
        procs = [psutil.Process(node.p.pid), *_descendants(node)]
        node.p.send_signal(signal.SIGTERM)
        assert node.p.wait(30) == 0, node.log()[-2000:]  # closed (not killed by the signal's default action)
        assert "mid-build" in node.log()
    finally:
        svc.stop_all()
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, [p.cmdline()[:2] for p in alive]
    time.sleep(1)
    leftovers = [p for p in psutil.process_iter(["name", "ppid", "status"]) if p.info["name"] in ("cc1plus", "g++")
                 and p.info["ppid"] == 1 and p.info["status"] != psutil.STATUS_ZOMBIE]  # killed: a zombie until reaped
    assert not leftovers, leftovers
