"""Routing by cache through real processes: two `both` nodes of a tiny model (SmolLM2's tokenizer bundle,
random weights) and a gateway over them. A prefix one node holds draws its repeats there (the nodes' hit
metrics and each answer's cached_tokens say so); a new prompt goes by load; a salted prompt does not match
an unsalted holder; the index folded from a node's events equals the node's snapshot; a node drained or
removed leaves the registry's index; on a split pool (2 prefill + 1 decode), the prefill node holding the prefix
is taken, and a decode node holding all but a few tokens takes the whole request."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from compute.node.client import AsyncNodeClient
from compute.node.launcher import Services
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.registry import NodeRegistry
from tests.conftest import import_tiny_chat_models
from tests.services import AUTH, TOKEN, metric, node_generate, until, wait_for

pytestmark = pytest.mark.slow
MODEL = "tiny-r"
BS = 16  # the nodes' default block size
KEYS = ("sk-tenant-a", "sk-tenant-b")  # the keyed gateway's API keys: one tenant each (cache_isolation per_key)
FIXED = ("--kernels", "fixed")  # no background kernel measurement competing for the 2 cores
SHOW = ("--report-cached-tokens", "always")  # a keyless gateway's usage says cached_tokens only when told to


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, (MODEL,), "routing-store", context=1024)
    services = Services(store.locations, None, str(tmp_path_factory.mktemp("routing")), TOKEN)
    try:
        nodes = [services.node("both", kv_blocks=256, model=MODEL, extra=FIXED) for _ in range(2)]
        gw = services.gateway([("both", n) for n in nodes], extra=SHOW)
        keyed = services.gateway([("both", n) for n in nodes], env={"PDSERVE_API_KEYS": ",".join(KEYS)})
        quiet = services.gateway([("both", n) for n in nodes])  # the defaults: no keys, so a shared cache
        for p in (*nodes, gw, keyed, quiet):
            p.wait_ready()
        lo, hi = sorted(nodes, key=lambda n: n.url)  # with equal load the router takes `lo` (the URL breaks ties)
        yield {"lo": lo, "hi": hi, "gw": gw, "keyed": keyed, "quiet": quiet}
    finally:
        services.stop_all()


def usage(gw, ids: list[int], key: str | None = None, **extra) -> dict:
    """The usage of one greedy completion of token ids through the gateway (with API key `key`)."""
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                     "temperature": 0, **extra},
                   headers={"Authorization": f"Bearer {key}"} if key else None, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def complete(gw, ids: list[int], key: str | None = None, **extra) -> int:
    """One greedy completion of token ids through the gateway; -> its cached_tokens."""
    return (usage(gw, ids, key, **extra).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def indexed(gw, node) -> int:
    """Blocks the gateway's index holds for ``node`` (its /internal/status)."""
    st = httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()
    return (st.get("prefix_index") or {}).get(node.url, {}).get(MODEL, 0)


def seen_idle(gw, node) -> bool:
    """The gateway's last /load of ``node`` shows nothing queued or running: a warm-up sent straight to the node
    is over in its view too (a stale reading would weigh the finished warm-up's prompt against the node)."""
    st = httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()
    ld = next((n["load"] for n in st["nodes"] if n["url"] == node.url), None)
    return ld is not None and not ld.get("queued_prompt_tokens") and not ld.get("running")


def hits(node) -> float:
    return metric(node.url, "pdserve_node_prefix_cache_hits_total")


def queries(node) -> float:
    return metric(node.url, "pdserve_node_prefix_cache_queries_total")


def test_a_repeated_prefix_goes_to_its_holder_and_a_new_one_by_load(svc):
    lo, hi, gw = svc["lo"], svc["hi"], svc["gw"]
    a, b = prompt(1), prompt(2)
    before = indexed(gw, hi)
    node_generate(hi, "warm-a", a, 1)  # hi holds A; by load alone the gateway would pick lo
    wait_for(lambda: indexed(gw, hi) >= before + len(a) // BS - 1, 10, "the gateway's index to see hi's blocks")
    wait_for(lambda: seen_idle(gw, hi), 10, "the gateway to see hi idle after its warm-up")
    lo_h, hi_h, lo_q = hits(lo), hits(hi), queries(lo)
    by_hit = metric(gw.url, "pdserve_gateway_routed_total", by="hit")
    cached = [complete(gw, a) for _ in range(3)]  # back to back: the gateway discounts what finished since its poll
    assert all(c >= (len(a) - 2) // BS * BS - BS for c in cached), cached
    assert hits(hi) - hi_h == sum(cached) and hits(lo) == lo_h and queries(lo) == lo_q
    assert metric(gw.url, "pdserve_gateway_routed_total", by="hit") - by_hit == 3
    # a new prompt: no hit anywhere -> by load (lo: the tie-break), then its repeat hits there
    by_load = metric(gw.url, "pdserve_gateway_routed_total", by="load")
    assert complete(gw, b) == 0 and queries(lo) - lo_q == len(b)
    assert metric(gw.url, "pdserve_gateway_routed_total", by="load") - by_load == 1
    assert complete(gw, b) > 0 and hits(lo) > lo_h  # the repeat hits lo: its events or what the gateway sent


def test_a_salted_request_does_not_match_an_unsalted_holder(svc):
    lo, hi, gw = svc["lo"], svc["hi"], svc["gw"]
    a = prompt(3)
    before = indexed(gw, hi)
    node_generate(hi, "warm-salt", a, 1)
    wait_for(lambda: indexed(gw, hi) >= before + len(a) // BS - 1, 10, "the gateway's index to see hi's blocks")
    wait_for(lambda: seen_idle(gw, hi), 10, "the gateway to see hi idle after its warm-up")
    lo_q, hi_q = queries(lo), queries(hi)
    assert complete(gw, a, cache_salt="tenant-1") == 0
    assert queries(lo) - lo_q == len(a) and queries(hi) == hi_q  # routed by load, not to the unsalted holder
    assert complete(gw, a, cache_salt="tenant-1") > 0  # its own salt's blocks, where it went
    assert complete(gw, a) > 0  # unsalted: the holder


def test_each_api_key_shares_cached_kv_only_with_itself(svc):
    keyed, (ka, kb) = svc["keyed"], KEYS
    a = prompt(11)
    assert complete(keyed, a, ka) == 0
    assert complete(keyed, a, ka) > 0  # the same key: its own blocks
    assert complete(keyed, a, kb) == 0  # another key: nothing in common, wherever it went
    assert complete(keyed, a, kb) > 0
    assert complete(keyed, a, kb, cache_salt="x") == 0  # a client's salt adds to its key's, never replaces it
    assert complete(svc["gw"], a) == 0  # the keyless gateway's requests are no tenant's


def test_a_shared_cache_does_not_say_what_it_holds(svc):
    """With no API keys every caller shares one cache: the defaults leave cached_tokens out of usage (it would
    tell a caller whether someone else sent the prompt), though the node's cache hits as ever."""
    quiet, lo, hi = svc["quiet"], svc["lo"], svc["hi"]
    a = prompt(21)
    first = usage(quiet, a)
    before = hits(lo) + hits(hi)
    again = usage(quiet, a)
    assert hits(lo) + hits(hi) - before >= (len(a) - 2) // BS * BS - BS  # the repeat did hit
    assert "prompt_tokens_details" not in first and "prompt_tokens_details" not in again, (first, again)
    assert again["prompt_tokens"] == len(a) and again["completion_tokens"] == 2


def test_the_index_folded_from_events_equals_the_nodes_snapshot(svc):
    lo = svc["lo"]
    ev0 = metric(lo.url, "pdserve_node_prefix_cache_evictions_total")

    async def go():
        index = PrefixIndex()
        async with AsyncNodeClient(TOKEN, timeout_s=30) as client:
            first = await client.cache(lo.url, {})
            assert first.models[MODEL].resync and first.models[MODEL].block_size == BS
            index.apply(lo.url, first)
            for i in range(6):  # 6 x 900 tokens through 256 blocks of 16: evictions (removed events) too
                await asyncio.to_thread(node_generate, lo, f"fill-{i}", prompt(100 + i, 900), 1)
                report = await client.cache(lo.url, index.cursors(lo.url))
                assert not report.models[MODEL].resync
                index.apply(lo.url, report)
            snap = await client.cache(lo.url, {})
        return index, snap.models[MODEL]

    index, snap = asyncio.run(go())
    assert snap.resync and index.held(lo.url, MODEL) == set(snap.stored)
    assert metric(lo.url, "pdserve_node_prefix_cache_evictions_total") > ev0
    assert len(snap.stored) <= 256


def test_a_drained_or_removed_node_leaves_the_index(svc):
    lo, hi = svc["lo"], svc["hi"]
    a = prompt(4)
    node_generate(lo, "warm-lo", a, 1)
    node_generate(hi, "warm-hi", a, 1)

    async def go():
        reg = NodeRegistry(TOKEN, interval_s=60, index=PrefixIndex())
        reg.add(lo.url, "both")
        reg.add(hi.url, "both")
        await reg.start()  # the first poll; each node's cache is asked for beside it
        try:
            full = (len(a) - 2) // BS * BS
            await until(lambda: reg.index.match(MODEL, a).hits == {lo.url: full, hi.url: full}, 10,
                        "both nodes' reports in the index")  # fmt: skip
            reg.mark_draining(lo.url)
            assert reg.index.held(lo.url, MODEL) == set()
            await reg.poll_once()  # a draining node is not asked again
            assert reg.index.match(MODEL, a).hits == {hi.url: full}
            reg.remove(hi.url)
            assert reg.index.match(MODEL, a).hits == {} and reg.index.nodes() == []
        finally:
            await reg.stop()

    asyncio.run(go())


@pytest.fixture(scope="module")
def split(tmp_path_factory, real_model_store):
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, (MODEL,), "routing-split-store", context=1024)
    services = Services(store.locations, None, str(tmp_path_factory.mktemp("routing-split")), TOKEN)
    try:
        prefills = [services.node("prefill", kv_blocks=256, model=MODEL, extra=FIXED) for _ in range(2)]
        decode = services.node("decode", kv_blocks=256, model=MODEL, extra=FIXED)
        gw = services.gateway([*(("prefill", n) for n in prefills), ("decode", decode)], extra=SHOW)
        for p in (*prefills, decode, gw):
            p.wait_ready()
        lo, hi = sorted(prefills, key=lambda n: n.url)
        yield {"lo": lo, "hi": hi, "gw": gw, "decode": decode}
    finally:
        services.stop_all()


def test_a_decode_node_holding_all_but_a_few_tokens_takes_the_whole_request(split):
    """Conditional disaggregation (gateway/routing/router.py, ``Weights.local_tokens``): the decode node kept the
    8 full blocks it imported; the same 130-token prompt again leaves 2 tokens, which it computes itself."""
    lo, hi, gw, decode = split["lo"], split["hi"], split["gw"], split["decode"]
    a = prompt(61, n=8 * BS + 2)
    assert complete(gw, a) == 0  # split: the decode node imports the prompt and keeps its full blocks
    wait_for(lambda: indexed(gw, decode) >= 8, 10, "the gateway's index to see the decode node's blocks")
    asked, got = queries(lo) + queries(hi), hits(decode)
    assert complete(gw, a) == 8 * BS  # the decode node's own hit
    assert hits(decode) - got == 8 * BS and queries(lo) + queries(hi) == asked  # no prefill node was asked


def test_a_split_route_takes_the_prefill_node_holding_the_prefix(split):
    lo, hi, gw = split["lo"], split["hi"], split["gw"]
    a = prompt(5)
    node_generate(hi, "warm-split", a, 1)  # the prefill node hi holds A
    wait_for(lambda: indexed(gw, hi) >= len(a) // BS - 1, 10, "the gateway's index to see hi's blocks")
    wait_for(lambda: seen_idle(gw, hi), 10, "the gateway to see hi idle after its warm-up")
    lo_q, hi_h = queries(lo), hits(hi)
    cached = [complete(gw, a) for _ in range(2)]  # back to back (see the first test)
    got = (cached, hits(hi) - hi_h, queries(lo) - lo_q)
    assert all(c > 0 for c in cached) and hits(hi) - hi_h == sum(cached) and queries(lo) == lo_q, got
