"""Many models through one gateway.

Pure parts first (no process): routing per model from each node's /load (a node of several models,
and an old node of one), the activator holding a request until a node holds its model, the
per-model traffic figures with a fake clock. Then real processes: two tiny models in one store,
a node holding each, gateways over them; the real `openai` client gets each model's answer,
identical to a gateway over a node holding only that model; /v1/models lists both; a model no node
holds is held by the activator (the test places it through the gateway's internal API, watching
/internal/status "held") and answered; past the deadline 503 with Retry-After; unknown -> 404;
`pdserve status` prints per model.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.activator import Activator, NotPlaced
from gateway.registry import NodeRegistry
from gateway.traffic import Traffic
from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder
from tests.services import HEADERS, start_gateway, start_node, wait_for

Q = [{"role": "user", "content": "What is the capital of France?"}]


# --- routing per model (pure) -----------------------------------------------------------------------
def _registry(loads: dict[str, tuple[str, dict]]) -> NodeRegistry:
    reg = NodeRegistry(HEADERS)
    for url, (role, load) in loads.items():
        n = reg.add(url, role)
        n.load, n.healthy = load, True
    return reg


def _model(state: str, **kw) -> dict:
    return {"state": state, "queued_prompt_tokens": 0, "running": 0, "kv_blocks_free": 10, **kw}


def test_views_see_each_node_as_it_serves_one_model():
    reg = _registry({
        "http://m": ("both", {"state": "ready", "ready": True, "model": "a", "running": 9, "kv_blocks_free": 1,
                              "models": {"a": _model("ready", running=2, kv_blocks_free=7), "b": _model("loading")}}),
        "http://old": ("both", {"ready": True, "model": "a", "running": 5, "kv_blocks_free": 3}),
        "http://standby": ("both", {"state": "standby", "ready": False, "model": None, "models": {}}),
    })  # fmt: skip
    a = {v.url: v for v in reg.views("a")}
    assert a["http://m"].routable and (a["http://m"].running, a["http://m"].kv_blocks_free) == (2, 7)
    assert a["http://old"].routable and a["http://old"].running == 5  # an old node holds its top-level model
    assert not a["http://standby"].routable
    assert not any(v.routable for v in reg.views("b"))  # still loading
    assert not any(v.routable for v in reg.views("c"))
    assert reg.routable_models() == {"a"}
    reg.nodes["http://m"].load["models"]["a"]["state"] = "draining"
    assert not {v.url: v for v in reg.views("a")}["http://m"].routable
    assert reg.nodes["http://standby"].as_dict()["state"] == "standby"
    assert reg.nodes["http://m"].as_dict()["models"] == {"a": "draining", "b": "loading"}


def test_activator_holds_until_a_node_holds_the_model_then_routes_there():
    async def scenario():
        reg = _registry({"http://a": ("both", {"ready": True, "model": "a"})})
        act = Activator(reg, interval_s=0.2, poll_s=0.02)
        calls: list[tuple[str, float]] = []
        act.activate = lambda m: calls.append((m, time.monotonic()))
        assert (await act.hold("a", time.monotonic() + 1)).both == "http://a"  # routable: no hold, no call
        assert calls == [] and act.held == {}
        task = asyncio.create_task(act.hold("b", time.monotonic() + 5))
        await asyncio.sleep(0.5)
        assert act.held == {"b": 1} and not task.done()
        n = reg.add("http://b", "both")  # the placer registers a node that now holds b
        n.load, n.healthy = {"state": "ready", "ready": True, "models": {"b": _model("ready")}}, True
        route = await asyncio.wait_for(task, 1)
        assert route.both == "http://b" and act.held == {}
        gaps = [t2 - t1 for (_, t1), (_, t2) in zip(calls, calls[1:])]
        assert {m for m, _ in calls} == {"b"} and 2 <= len(calls) <= 4 and all(g >= 0.19 for g in gaps), calls
        t0 = time.monotonic()
        with pytest.raises(NotPlaced) as e:
            await act.hold("c", time.monotonic() + 0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.0 and e.value.retry_after >= 1 and "'c'" in str(e.value)
        assert act.held == {}

    asyncio.run(scenario())


def test_traffic_per_model_over_the_last_minute_with_a_fake_clock():
    now = {"m": 100.0, "w": 1000.0}
    tr = Traffic(clock=lambda: now["m"], wall=lambda: now["w"])
    now["w"] += 5
    assert tr.snapshot("a")["idle_s"] == 5.0 and tr.snapshot("a")["last_request_t"] is None
    tr.arrived("a")
    tr.admitting("a", 1)
    assert tr.snapshot("a", held=2)["queue_depth"] == 3
    tr.admitting("a", -1)
    tr.admitted("a", 0.5)
    tr.first_token("a", 0.8)
    s = tr.snapshot("a")
    assert (s["running"], s["requests"], s["idle_s"], s["queue_wait_p99_s"], s["ttft_p99_s"]) == (1, 1, 0.0, 0.5, 0.8)
    now["m"] += 2.0
    tr.finished("a", tokens=11, first_t=100.0, end_t=102.0)  # 10 tokens after the first in 2 s
    now["w"] += 3
    s = tr.snapshot("a")
    assert s["running"] == 0 and s["tpot_p99_s"] == pytest.approx(0.2) and s["idle_s"] == 3.0
    assert tr.snapshot("b")["requests"] == 0
    now["m"] += 61  # the samples leave the window; the counts stay
    s = tr.snapshot("a")
    assert (s["ttft_p99_s"], s["tpot_p99_s"], s["queue_wait_p99_s"], s["requests"]) == (0.0, 0.0, 0.0, 1)


# --- real processes ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_models(tmp_path_factory, real_model_store):
    """Two tiny Llamas (different random weights) with SmolLM2's tokenizer bundle, in one store."""
    from paramstore import ParamStore, StoreConfig

    locations, name = real_model_store
    with ParamStore(StoreConfig(locations=locations)) as ps, ps.reader(ps.manifest(name)) as r:
        files = r.bundle()
    store = StoreConfig.local_default(str(tmp_path_factory.mktemp("two-model-store")), k=4, m=2)
    cfg = tiny_llama_config(vocab=49152, tied=True)
    with ParamStore(store) as ps:
        for seed, model in enumerate(("tiny-a", "tiny-b")):
            folder = write_hf_folder(tmp_path_factory.mktemp(model), cfg, tiny_llama_tensors(cfg, seed=seed), files=1)
            for fname, data in files.items():
                with open(os.path.join(folder, fname), "wb") as f:
                    f.write(data)
            ps.import_model(folder, model)
    return store.locations


@pytest.fixture(scope="module")
def svc(tmp_path_factory, two_models):
    """Node A (holds tiny-a), node B (tiny-b); gateways: `multi` over both; `only_a` over A alone
    serving both models (a short hold); `cold` over A alone serving both (a long hold)."""
    tmp = tmp_path_factory.mktemp("models")
    procs = []
    try:
        a = start_node(tmp, two_models, "tiny-a", "both")
        procs.append(a)
        b = start_node(tmp, two_models, "tiny-b", "both")
        procs.append(b)
        both = ("--model", "tiny-b")
        gws = {}
        for key, nodes, extra in (("multi", [a, b], both), ("only_a", [a], (*both, "--queue-timeout", "2")),
                                  ("cold", [a], (*both, "--queue-timeout", "60"))):  # fmt: skip
            gws[key] = start_gateway(tmp, two_models, "tiny-a", [("both", n) for n in nodes], extra)
            procs.append(gws[key])
        for p in procs:
            p.wait_ready()
        yield {"a": a, "b": b, **gws}
    finally:
        for p in procs:
            p.stop()


def _client(gw):
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _answer(gw, model: str) -> str:
    r = _client(gw).chat.completions.create(model=model, messages=Q, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert r.model == model and r.usage.completion_tokens == 8
    return r.choices[0].message.content


@pytest.mark.slow
def test_two_models_through_one_gateway_answer_as_their_own_nodes(svc):
    pytest.importorskip("openai")
    c = _client(svc["multi"])
    assert sorted(m.id for m in c.models.list().data) == ["tiny-a", "tiny-b"]
    a, b = _answer(svc["multi"], "tiny-a"), _answer(svc["multi"], "tiny-b")
    assert a != b  # two different models answered (different random weights)
    assert a == _answer(svc["only_a"], "tiny-a")  # a gateway over a node holding only tiny-a
    chunks = list(c.chat.completions.create(model="tiny-b", messages=Q, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == b
    assert {ch.model for ch in chunks} == {"tiny-b"}
    st = httpx.get(svc["multi"].url + "/internal/status", headers=HEADERS, timeout=5).json()
    for m in ("tiny-a", "tiny-b"):
        s = st["models"][m]
        assert s["requests"] >= 1 and s["held"] == 0 and s["running"] == 0 and s["last_request_t"] > 0
        assert s["ttft_p99_s"] > 0 and s["tpot_p99_s"] > 0 and s["idle_s"] >= 0
    assert st["models"]["tiny-b"]["requests"] == 2


@pytest.mark.slow
def test_unknown_model_is_404_naming_the_served_ones(svc):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        _client(svc["multi"]).chat.completions.create(model="nope", messages=Q, max_tokens=4)
    assert "'nope'" in str(e.value) and "tiny-a" in str(e.value) and "tiny-b" in str(e.value)


@pytest.mark.slow
def test_a_model_no_node_holds_is_503_with_retry_after_past_the_deadline(svc):
    body = {"model": "tiny-b", "messages": Q, "max_tokens": 4}
    t0 = time.monotonic()
    r = httpx.post(svc["only_a"].url + "/v1/chat/completions", json=body, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert "tiny-b" in r.json()["error"]["message"] and 2.0 <= took < 15, (took, r.text)
    assert httpx.get(svc["only_a"].url + "/ready", timeout=5).status_code == 200  # tiny-a is routable


@pytest.mark.slow
def test_a_held_request_is_answered_once_its_model_is_placed(svc):
    """The test is the placer: it sees the request held in /internal/status, then gives the gateway a
    node that holds the model (through the internal API, as the autoscaler does)."""
    gw = svc["cold"]
    want = _answer(svc["multi"], "tiny-b")
    out: dict = {}

    def ask():
        t0 = time.monotonic()
        out["answer"] = _answer(gw, "tiny-b")
        out["took"] = time.monotonic() - t0

    th = threading.Thread(target=ask)
    th.start()
    try:
        def held():
            st = httpx.get(gw.url + "/internal/status", headers=HEADERS, timeout=5).json()
            return st["models"].get("tiny-b", {}).get("held") == 1 and st["models"]["tiny-b"]["queue_depth"] == 1
        wait_for(held, 30, "the request for tiny-b held")
        t_place = time.monotonic()
        r = httpx.post(gw.url + "/internal/nodes", json={"url": svc["b"].url, "role": "both"}, headers=HEADERS,
                       timeout=10)  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        th.join(60)
    assert not th.is_alive() and out.get("answer") == want, out
    served_after = time.monotonic() - t_place
    st = httpx.get(gw.url + "/internal/status", headers=HEADERS, timeout=5).json()
    assert st["models"]["tiny-b"]["held"] == 0 and served_after < out["took"], (served_after, out)


@pytest.mark.slow
def test_pdserve_status_prints_each_model_with_its_nodes_and_decision(svc):
    gw = svc["multi"]
    report = {"decision": {"t": time.time(), "roles": {
        "tiny-a/both": {"model": "tiny-a", "role": "both", "replicas": 2, "current": 1, "reason": "ttft over its slo"},
        "tiny-b/both": {"model": "tiny-b", "role": "both", "replicas": 1, "current": 1, "reason": "steady"}}},
        "reason": "tiny-a/both: ttft over its slo", "actuator": "test"}  # fmt: skip
    assert httpx.post(gw.url + "/internal/autoscaler", json=report, headers=HEADERS, timeout=5).status_code == 200
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    r = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", gw.url], capture_output=True,
                       text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    ia = next(i for i, ln in enumerate(lines) if ln.startswith("model tiny-a:"))
    ib = next(i for i, ln in enumerate(lines) if ln.startswith("model tiny-b:"))
    block_a = "\n".join(lines[ia:ib] if ia < ib else lines[ia:])
    assert svc["a"].url in block_a and svc["b"].url not in block_a and " ready " in block_a
    assert "autoscaler both: 1 -> 2 replicas: ttft over its slo" in block_a, r.stdout
    assert "steady" in "\n".join(lines[ib:]), r.stdout
