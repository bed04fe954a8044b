"""Many models through one gateway.

Pure parts first (no process): routing per model from each node's /load (a node of several models,
and an old node of one), the activator holding a request until a node holds its model (the per-model
traffic figures: tests/gateway/admission/test_traffic.py). Then real processes: two tiny models in one store,
a node holding each, gateways over them; the real `openai` client gets each model's answer,
identical to a gateway over a node holding only that model; /v1/models lists both; a model no node
holds is held by the activator (the test places it through the gateway's internal API, watching
/internal/status "held") and answered; past the deadline 503 with Retry-After; unknown -> 404;
`pdserve status` prints per model.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest

from compute.node import protocol as P
from compute.node.launcher import Services
from gateway.routing.activator import Activator, NotPlaced
from gateway.routing.registry import NodeRegistry
from tests.conftest import import_tiny_chat_models
from tests.services import (
    AUTH,
    INVARIANT,
    TOKEN,
    until,
    wait_for,
    wait_kernels_settled,
)

Q = [{"role": "user", "content": "What is the capital of France?"}]


# --- routing per model (pure) -----------------------------------------------------------------------
def _registry(loads: dict[str, tuple[str, dict]]) -> NodeRegistry:
    reg = NodeRegistry(TOKEN)
    for url, (role, load) in loads.items():
        n = reg.add(url, role)
        n.load, n.healthy, n.proven = _report(load), True, True  # as after its proof and a good poll
    return reg


def _model(state: str, **kw) -> dict:
    return {"state": state, "queued_prompt_tokens": 0, "running": 0, "kv_blocks_free": 10, **kw}


def _report(load: dict) -> P.LoadReport:
    """A node's /load as the registry holds it, from plain data (each model entry named by its key)."""
    models = {m: {"model": m, **d} for m, d in load.get("models", {}).items()}
    return msgspec.convert({**load, "models": models}, P.LoadReport)


def test_views_see_each_node_as_it_serves_one_model():
    reg = _registry({
        "http://m": ("both", {"state": "ready", "ready": True, "model": "a", "running": 9, "kv_blocks_free": 1,
                              "models": {"a": _model("ready", running=2, kv_blocks_free=7), "b": _model("loading")}}),
        "http://standby": ("both", {"state": "standby", "ready": False, "model": None, "models": {}}),
    })  # fmt: skip
    a = {v.url: v for v in reg.views("a")}
    assert a["http://m"].routable and (a["http://m"].running, a["http://m"].kv_blocks_free) == (2, 7)
    assert not a["http://standby"].routable
    assert not any(v.routable for v in reg.views("b"))  # still loading
    assert not any(v.routable for v in reg.views("c"))
    assert reg.routable_models() == {"a"}
    reg.nodes["http://m"].load.models["a"].state = "draining"
    assert not {v.url: v for v in reg.views("a")}["http://m"].routable
    assert reg.nodes["http://standby"].as_dict()["state"] == "standby"
    assert reg.nodes["http://m"].as_dict()["models"] == {"a": "draining", "b": "loading"}


def test_activator_holds_until_a_node_holds_the_model_then_routes_there():
    """Stepped on a fake clock (the activator's; its loop re-reads the registry every poll_s of real time, and
    the test lets it run a few turns between two steps): activate is called when a hold starts, then once per
    interval_s of the clock, never more often; a node that holds the model ends the hold; NotPlaced comes at
    the deadline, not a turn before."""

    async def scenario():
        now = [100.0]
        reg = _registry({"http://a": ("both", {"state": "ready", "ready": True, "models": {"a": _model("ready")}})})
        act = Activator(reg, interval_s=0.25, poll_s=0.01, clock=lambda: now[0])
        calls: list[tuple[str, float]] = []
        act.activate = lambda m: calls.append((m, now[0]))
        turns, wait_changed = [0], reg.wait_changed

        async def counted(timeout: float) -> None:
            turns[0] += 1
            await wait_changed(timeout)

        reg.wait_changed = counted

        async def step(dt: float) -> None:  # the clock moves on, then the hold loop runs 3 more turns
            now[0] += dt
            target = turns[0] + 3
            await until(lambda: turns[0] >= target, 30, "three turns of the hold's loop")

        assert (await act.hold("a", now[0] + 1)).both == "http://a"  # routable: no hold, no call
        assert calls == [] and act.held == {}
        task = asyncio.create_task(act.hold("b", now[0] + 5))
        await step(0)
        assert act.held == {"b": 1} and not task.done() and calls == [("b", 100.0)]  # at once
        await step(0.125)
        assert calls == [("b", 100.0)]  # within interval_s: not again
        await step(0.125)
        assert calls == [("b", 100.0), ("b", 100.25)]
        await step(0.125)
        assert len(calls) == 2 and not task.done()
        n = reg.add("http://b", "both")  # the placer registers a node that now holds b
        n.load = _report({"state": "ready", "ready": True, "models": {"b": _model("ready")}})
        n.healthy = n.proven = True  # (as after its proof and a good poll)
        route = await asyncio.wait_for(task, 30)  # seen at the next turn, the clock standing still
        assert route.both == "http://b" and act.held == {} and len(calls) == 2
        t0 = now[0]
        task = asyncio.create_task(act.hold("c", t0 + 0.5))
        await step(0)
        await step(0.375)
        assert not task.done() and act.held == {"c": 1}
        now[0] += 0.125  # the deadline: the next turn refuses
        with pytest.raises(NotPlaced) as e:
            await asyncio.wait_for(task, 30)
        assert e.value.retry_after == 1 and "'c'" in str(e.value) and "held 0.5 s" in str(e.value), e.value
        assert act.held == {} and calls[2:] == [("c", t0), ("c", t0 + 0.375)]

    asyncio.run(scenario())


def test_ready_when_a_model_is_routable_or_an_activator_can_place_one():
    from gateway.config import GatewayConfig
    from gateway.models import ModelCatalogue
    from gateway.service import Gateway

    gw = Gateway(GatewayConfig(models=["a", "b"]), ModelCatalogue(None, ["a", "b"]))
    assert not gw.ready()  # no node at all
    n = gw.registry.add("http://s", "both")
    n.load, n.healthy, n.proven = _report({"state": "standby", "ready": False, "model": None, "models": {}}), True, True
    assert not gw.ready()  # a standby runtime, and nothing to place a model on it
    gw.activate = lambda model: None
    assert gw.ready() and gw.activator.activate is gw.activate  # an activator can place one there
    gw.activate = None
    n.load = _report({"state": "ready", "ready": True, "model": "b", "models": {"b": _model("ready")}})
    assert gw.ready()


def test_catalogue_lists_the_store_on_a_miss_and_leaves_out_a_model_without_a_tokenizer(tmp_path, tiny_hf,
                                                                                         monkeypatch):  # fmt: skip
    from gateway import models
    from paramstore import ParamStore, StoreConfig

    monkeypatch.setattr(models, "MISS_RELIST_S", 0.0)
    with ParamStore(StoreConfig.local_default(str(tmp_path / "store"), k=2, m=1)) as ps:
        ps.import_model(tiny_hf[0], "ids-only", dtype="fp32")  # no tokenizer.json in its bundle
        cat = models.ModelCatalogue(ps)
        assert cat.relist() == ["ids-only"]

        async def scenario():
            with pytest.raises(models.UnknownModel, match="tokenizer"):
                await cat.text("ids-only")
            assert cat.names == []  # no longer listed as served
            with pytest.raises(models.UnknownModel, match="'later' does not exist"):
                await cat.check("later")
            ps.import_model(tiny_hf[0], "later", dtype="fp32")
            await cat.check("later")  # a miss lists the store again: now served
            assert cat.names == ["later"]

        asyncio.run(scenario())


# --- real processes ---------------------------------------------------------------------------------
MODELS = ("tiny-a", "tiny-b", "tiny-c")


@pytest.fixture(scope="module")
def three_models(tmp_path_factory, real_model_store):
    """Three tiny Llamas (different random weights) with SmolLM2's tokenizer bundle, in one store."""
    return import_tiny_chat_models(tmp_path_factory, *real_model_store, MODELS, "models-store").locations


@pytest.fixture(scope="module")
def svc(tmp_path_factory, three_models):
    """Nodes: A (tiny-a at start), B (tiny-b at start), S (standby: no model). Gateways serving every
    model of the store (no --model): `multi` over A, B and S (a 60 s hold); `short` over A alone
    (a 2 s hold). A model's answers are compared across nodes (random weights: a near-tie at every token), so
    the nodes run kernels = invariant, all on one plan (tests/services.py)."""
    tmp = tmp_path_factory.mktemp("models")
    services = Services(three_models, None, str(tmp), TOKEN)
    try:
        a = services.node("both", kv_blocks=256, model="tiny-a", extra=INVARIANT)
        b = services.node("both", kv_blocks=256, model="tiny-b", extra=INVARIANT)
        standby = services.node("both", kv_blocks=256, model=None, extra=INVARIANT)
        multi = services.gateway([("both", n) for n in (a, b, standby)], ("--queue-timeout", "60"))
        short = services.gateway([("both", a)], ("--queue-timeout", "2"))
        for p in (a, b, standby, multi, short):
            p.wait_ready()
        wait_kernels_settled([a, b])
        yield {"a": a, "b": b, "s": standby, "multi": multi, "short": short}
    finally:
        services.stop_all()


def _client(gw):
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _answer(gw, model: str) -> str:
    r = _client(gw).chat.completions.create(model=model, messages=Q, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert r.model == model and r.usage.completion_tokens == 8
    return r.choices[0].message.content


def _status(gw) -> dict:
    return httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()


def _load_model(node, model: str) -> float:
    """POST /internal/models/load to `node`; -> the time it was sent (monotonic)."""
    t = time.monotonic()
    r = httpx.post(node.url + "/internal/models/load", json={"model": model}, auth=AUTH, timeout=30)
    assert r.status_code in (200, 202), r.text
    return t


@pytest.mark.slow
def test_two_models_on_one_node_answer_as_nodes_holding_only_that_model(svc):
    pytest.importorskip("openai")
    assert sorted(m.id for m in _client(svc["multi"]).models.list().data) == list(MODELS)  # every model in the store
    want_a = _answer(svc["short"], "tiny-a")  # node A holds only tiny-a
    want_b = _answer(svc["multi"], "tiny-b")  # only node B holds tiny-b
    assert want_a != want_b  # two different models answered (different random weights)
    _load_model(svc["a"], "tiny-b")  # node A now holds both
    wait_for(lambda: svc["a"].load()["models"].get("tiny-b", {}).get("state") == "ready", 60, "tiny-b ready on A")
    wait_kernels_settled([svc["a"]])  # A's tiny-b on its final plan (B's) before its first request
    short = svc["short"]  # its only node, A, holds both models now
    wait_for(lambda: httpx.get(short.url + "/admin/status", headers=short.admin_headers, timeout=5).json()["nodes"][0]["models"].get("tiny-b")
             == "ready", 10, "the gateway to see tiny-b on A")  # fmt: skip
    assert (_answer(short, "tiny-a"), _answer(short, "tiny-b")) == (want_a, want_b)
    c = _client(short)
    chunks = list(c.chat.completions.create(model="tiny-b", messages=Q, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_b
    assert {ch.model for ch in chunks} == {"tiny-b"}
    st = _status(short)
    for m in ("tiny-a", "tiny-b"):
        s = st["models"][m]
        assert s["requests"] >= 1 and s["held"] == 0 and s["running"] == 0 and s["last_request_t"] > 0
        assert s["ttft_p99_s"] > 0 and s["tpot_p99_s"] > 0 and s["idle_s"] >= 0
    assert (st["models"]["tiny-a"]["requests"], st["models"]["tiny-b"]["requests"]) == (2, 2)
    assert st["models"]["tiny-c"]["requests"] == 0


@pytest.mark.slow
def test_unknown_model_is_404_naming_the_served_ones(svc):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        _client(svc["multi"]).chat.completions.create(model="nope", messages=Q, max_tokens=4)
    assert "'nope'" in str(e.value) and all(m in str(e.value) for m in MODELS)
    doc = httpx.get(svc["multi"].url + "/openapi.json", timeout=30).json()
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["model"]["enum"] == list(MODELS)
    assert doc["paths"]["/v1/chat/completions"]["post"]["responses"]["503"]["headers"]["Retry-After"]


@pytest.mark.slow
def test_a_model_no_node_holds_is_503_with_retry_after_past_the_deadline(svc):
    """Refused at the gateway's 2 s deadline: not before it (the client's clock) and not held on past it (the
    gateway's own account of the hold, its clock, free of this machine's HTTP and tokenizer time: under a
    second deadline's length, where a hold that missed its deadline would run to the client's timeout)."""
    body = {"model": "tiny-c", "messages": Q, "max_tokens": 4}
    deadline = 2.0  # the `short` gateway's --queue-timeout
    t0 = time.monotonic()
    r = httpx.post(svc["short"].url + "/v1/chat/completions", json=body, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    message = r.json()["error"]["message"]
    held = float(re.search(r"(?:held|waited) (\d+(?:\.\d+)?) s", message).group(1))
    assert "tiny-c" in message and deadline <= held < 2 * deadline and took >= deadline, (took, message)
    assert _status(svc["short"])["models"]["tiny-c"]["held"] == 0
    assert httpx.get(svc["short"].url + "/ready", timeout=5).status_code == 200  # tiny-a is routable


@pytest.mark.slow
def test_pdserve_status_prints_each_model_with_its_nodes_decision_and_the_standby_runtimes(svc):
    gw = svc["multi"]
    report = {"decision": {"t": time.time(), "roles": {
        "tiny-a/both": {"model": "tiny-a", "role": "both", "replicas": 2, "current": 1, "reason": "ttft over its slo"},
        "tiny-b/both": {"model": "tiny-b", "role": "both", "replicas": 1, "current": 1, "reason": "steady"}}},
        "reason": "tiny-a/both: ttft over its slo", "actuator": "test"}  # fmt: skip
    assert httpx.post(gw.url + "/internal/autoscaler", json=report, auth=AUTH, timeout=5).status_code == 200
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    closed = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", gw.url], capture_output=True,
                            text=True, timeout=60, env=env, check=False)  # fmt: skip
    assert closed.returncode == 1 and "refused the admin key" in closed.stderr and "Traceback" not in closed.stderr
    env["PDSERVE_ADMIN_KEY"] = gw.admin_headers["Authorization"].removeprefix("Bearer ")
    r = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", gw.url], capture_output=True,
                       text=True, timeout=60, env=env, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    blocks = {ln.split(":")[0]: i for i, ln in enumerate(out.splitlines()) if ln.startswith(("model ", "standby"))}
    lines = out.splitlines()

    def block(start: str) -> str:
        i = blocks[start]
        ends = [j for j in blocks.values() if j > i]
        return "\n".join(lines[i:min(ends, default=len(lines))])

    a, c, standby = block("model tiny-a"), block("model tiny-c"), block("standby runtimes (no model held)")
    assert svc["a"].url in a and svc["b"].url not in a and " ready " in a, out
    assert "autoscaler both: 1 -> 2 replicas: ttft over its slo" in a, out
    assert "steady" in block("model tiny-b"), out
    assert "no node holds it" in c and svc["s"].url in standby and "standby" in standby, out


@pytest.mark.slow
def test_a_held_request_is_answered_once_a_standby_node_loads_its_model(svc):
    """The test is the placer, as the autoscaler is: it sees the request held in /internal/status,
    then loads the model onto the standby node through the node's internal API."""
    gw, standby = svc["multi"], svc["s"]
    out: dict = {}

    def ask():
        t0 = time.monotonic()
        try:
            out["answer"] = _answer(gw, "tiny-c")
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            out["error"] = repr(e)
        out["done"] = time.monotonic()
        out["took"] = out["done"] - t0

    th = threading.Thread(target=ask)
    th.start()
    try:
        wait_for(lambda: _status(gw)["models"].get("tiny-c", {}).get("held") == 1, 30, "the request for tiny-c held")
        assert _status(gw)["models"]["tiny-c"]["queue_depth"] == 1 and not out
        t_place = _load_model(standby, "tiny-c")
    finally:
        th.join(90)
    assert not th.is_alive() and "answer" in out, out
    assert out["done"] - t_place < out["took"]  # answered after the placement, not before
    print(f"held request answered {out['done'] - t_place:.2f} s after the load was sent (held {out['took']:.2f} s)")
    st = _status(gw)
    assert st["models"]["tiny-c"]["held"] == 0 and st["models"]["tiny-c"]["requests"] == 1
    assert standby.load()["models"].keys() == {"tiny-c"}  # the standby runtime now holds only tiny-c
    assert out["answer"] == _answer(gw, "tiny-c")  # the held request's answer is the model's answer
