"""Kernel plans across real node processes: nodes started together on a machine with no plan serve at once
(the rule), one of them measures (the lock beside the shared cache), the plan lands in the store, and a node
started later on another, empty cache takes the store's plan and measures nothing (its /metrics counter)."""

from __future__ import annotations

import json

import httpx
import pytest

from compute.kernels import int8, plans
from compute.node.launcher import Services
from paramstore import ParamStore, StoreConfig
from tests.services import TOKEN, metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory, tiny_hf):
    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("plans-store")), k=2, m=1)
    with ParamStore(cfg) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="int8")
    return cfg


def _kernels(node) -> dict:
    return node.load()["models"]["tiny"]["kernels"]


def test_nodes_of_one_machine_measure_once_and_a_later_node_measures_nothing(tmp_path, int8_store):
    svc = Services(int8_store.locations, "tiny", str(tmp_path), TOKEN)
    key = int8.machine_key(1)  # the nodes run 1 thread, as the test computes the key
    try:
        shared = ("--cache-dir", str(tmp_path / "machine-cache"))
        first = [svc.node("both", threads=1, kv_blocks=64, extra=shared) for _ in range(3)]
        for n in first:
            n.wait_ready(120)
        plans_total = "pdserve_node_kernel_plans_total"
        first_plans = [tuple(metric(n, plans_total, source=src) for src in ("rule", "local", "store")) for n in first]
        # each node was ready before any measurement: on the rule, or — started after a peer had measured (tiny
        # shapes take a second) — on the machine's cached table or the plan it published; never measured first.
        # A node loaded on the rule may already have swapped in its peer's plan by now (rule and local both 1)
        assert all(1 <= sum(p) <= 2 and max(p) == 1 for p in first_plans), first_plans
        assert any(p[0] == 1 for p in first_plans), first_plans

        def published():
            with ParamStore(int8_store) as store:
                try:
                    return store.plans.get(key)
                except Exception:  # noqa: BLE001 - not there yet
                    return None

        body = wait_for(published, 180, "the measured plan in the store", every=0.5)
        assert plans.complete(body["table"], [tuple(map(int, s.split("x"))) for s in body["table"]["shapes"]])
        # settled: its planner is done, or it had none (it was loaded after the plan was published: the store's)
        wait_for(lambda: all(_kernels(n)["measure"] in ("done", "none") for n in first), 60, "all plans settled")
        states = [_kernels(n) for n in first]
        assert all(s["source"] == "store" for s in states if s["measure"] == "none"), states
        counts = [metric(n, "pdserve_node_kernel_shapes_measured_total") for n in first]
        assert sum(counts) == len(body["table"]["shapes"]) and sorted(counts)[:2] == [0, 0], counts
        sources = [s["source"] for s in states]
        assert sources.count("measured") == 1 and set(sources) <= {"measured", "local", "peer", "store"}, sources

        later = svc.node("both", threads=1, kv_blocks=64, extra=("--cache-dir", str(tmp_path / "fresh-cache")))
        later.wait_ready(120)
        assert _kernels(later) == {"mode": "measured", "source": "store", "measure": "none"}
        assert metric(later, "pdserve_node_kernel_shapes_measured_total") == 0
        assert metric(later, plans_total, source="rule") == 0 and metric(later, plans_total, source="store") == 1
        body = {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4, "temperature": 0}}
        r = httpx.post(later.url + "/internal/generate", json=body, auth=later.auth, timeout=60)
        assert r.status_code == 200 and sum(len(json.loads(x)["token_ids"]) for x in r.text.splitlines()) == 4
    finally:
        svc.stop_all()
