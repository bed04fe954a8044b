"""Peer pull through the gateway, real processes: two `both` nodes of a tiny model with
SmolLM2's tokenizer under ``kernels = invariant``. A prefix cached on one node whose queue is long: its repeat is
routed to the idle node, which pulls the prefix's blocks from the holder instead of computing them (the gateway
counts the routed-with-pull, the idle node its pulled blocks and the answer's cached_tokens), and answers what the
holder answered. With peer pull off the same repeat is computed. A node joining the pool pre-pulls the hottest
prefix from its holder before any request (its first request then hits). No block leaks on any node after."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from compute.node.launcher import Services
from tests.conftest import import_tiny_chat_models
from tests.services import (
    AUTH,
    INVARIANT,
    TOKEN,
    metric,
    node_generate,
    wait_blocks_free,
    wait_for,
    wait_kernels_settled,
)

pytestmark = pytest.mark.slow
MODEL = "tiny-pull"
BS = 16


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, (MODEL,), "pull-store", context=1024)
    services = Services(store.locations, None, str(tmp_path_factory.mktemp("pull")), TOKEN)
    try:
        # the holder runs one sequence at a time: two long requests sent to it directly make its queue long
        holder = services.node("both", kv_blocks=256, model=MODEL, extra=(*INVARIANT, "--max-num-seqs", "1"))
        idle = services.node("both", kv_blocks=256, model=MODEL, extra=INVARIANT)
        show = ("--report-cached-tokens", "always")  # keyless gateways: usage says cached_tokens only when told to
        gw = services.gateway([("both", holder), ("both", idle)], extra=show)
        on = services.gateway([("both", holder), ("both", idle)], extra=("--no-peer-pull", *show))
        for p in (holder, idle, gw, on):
            p.wait_ready()
        wait_kernels_settled([holder, idle])
        yield {"holder": holder, "idle": idle, "gw": gw, "nopull": on, "services": services}
    finally:
        services.stop_all()


def complete(gw, ids: list[int], **extra) -> tuple[str, int]:
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4,
                                                     "temperature": 0, **extra}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def status_of(gw, node) -> dict:
    st = httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()
    return {"load": next(n["load"] for n in st["nodes"] if n["url"] == node.url),
            "indexed": (st.get("prefix_index") or {}).get(node.url, {}).get(MODEL, 0)}


def busy(node, tag: str) -> list[threading.Thread]:
    """Two long requests on ``node`` (one running, one queued: it runs one sequence at a time): its queue (400
    prompt tokens) outweighs what a 300-token prompt costs an empty node, pulled or not."""
    threads = [threading.Thread(target=node_generate, args=(node, f"{tag}-{i}", prompt(900 + i, 400), 600),
                                kwargs={"ignore_eos": True}, daemon=True) for i in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("mode", ["pull", "nopull"])
def test_a_busy_holders_repeat_is_pulled_by_the_idle_node(svc, mode):
    holder, idle = svc["holder"], svc["idle"]
    gw = svc["gw"] if mode == "pull" else svc["nopull"]
    ids = prompt(1 if mode == "pull" else 2)
    ref = node_generate(holder, f"warm-{mode}", ids, 4)  # the holder computes (and caches) the prefix
    n = (len(ids) - 2) // BS
    wait_for(lambda: status_of(gw, holder)["indexed"] >= n, 10, "the gateway's index to see the holder's blocks")
    pulls, pulled = metric(gw.url, "pdserve_gateway_routed_with_pull_total"), idle.load()["prefix_pulled"]
    threads = busy(holder, mode)
    try:
        wait_for(lambda: status_of(gw, holder)["load"]["queued_prompt_tokens"] > 0, 20, "the holder's queue")
        text, cached = complete(gw, ids)
        assert status_of(gw, holder)["load"]["queued_prompt_tokens"] > 0  # it was still busy: the idle node answered
    finally:
        for t in threads:
            t.join(120)
    ld = idle.load()
    assert len(ref) == 4 and text == complete(gw, ids, cache_salt=f"miss-{mode}")[0]  # == a recompute's answer
    if mode == "pull":
        assert metric(gw.url, "pdserve_gateway_routed_with_pull_total") - pulls == 1
        assert ld["prefix_pulled"] - pulled == n * BS and cached == n * BS
    else:
        assert metric(gw.url, "pdserve_gateway_routed_with_pull_total") == pulls and cached == 0
        assert ld["prefix_pulled"] == pulled
    loads = wait_blocks_free([holder, idle], timeout=20)
    assert [(x["kv_blocks_used"], x["kv_transfers_held"]) for x in loads] == [(0, 0), (0, 0)], loads


def test_a_node_joining_pre_pulls_the_hottest_prefix(svc):
    holder, gw = svc["holder"], svc["gw"]
    ids = prompt(7)
    n = (len(ids) - 2) // BS
    complete(gw, ids)  # routed (and counted hot) three times: the hottest chain
    wait_for(lambda: max(status_of(gw, holder)["indexed"], status_of(gw, svc["idle"])["indexed"]) >= n, 10,
             "the gateway's index to see the prefix's blocks")  # fmt: skip
    for _ in range(2):
        complete(gw, ids)
    before = metric(gw.url, "pdserve_gateway_prepulled_blocks_total")
    late = svc["services"].node("both", kv_blocks=256, model=MODEL, extra=INVARIANT)
    late.wait_ready()
    wait_kernels_settled([late])
    r = httpx.post(gw.url + "/admin/nodes", json={"url": late.url, "role": "both"}, headers=gw.admin_headers, timeout=10)
    assert r.status_code in (200, 201), r.text
    wait_for(lambda: late.load()["kv_blocks_cached"] >= n, 20, "the joining node to pre-pull the hottest prefix")
    assert metric(gw.url, "pdserve_gateway_prepulled_blocks_total") - before >= n
    body = {"request_id": "late-1", "prompt_token_ids": ids, "params": {"max_tokens": 4, "temperature": 0}}
    r = httpx.post(late.url + "/internal/generate", json=body, auth=AUTH, timeout=60)
    lines = [json.loads(x) for x in r.text.splitlines() if x]
    assert lines[0].get("cached_tokens") == n * BS  # its first request for it hits the pre-pulled blocks
    salted = dict(body, request_id="late-2", params=dict(body["params"], cache_salt="miss"))
    r2 = httpx.post(late.url + "/internal/generate", json=salted, auth=AUTH, timeout=60)
    assert [t for x in r.text.splitlines() if x for t in json.loads(x)["token_ids"]] == [
        t for x in r2.text.splitlines() if x for t in json.loads(x)["token_ids"]]  # == a recompute's answer
    loads = wait_blocks_free([holder, svc["idle"], late], timeout=20)
    assert [(x["kv_blocks_used"], x["kv_transfers_held"]) for x in loads] == [(0, 0)] * 3, loads
