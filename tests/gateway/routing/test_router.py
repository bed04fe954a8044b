"""The routing policy is a pure function: tables of node loads -> the route it must pick."""

from __future__ import annotations

from gateway.routing.router import NodeView, PullCost, Route, Weights, pick, prefill_cost


def P(url, q=0, running=0, **kw):
    return NodeView(url, "prefill", queued_prompt_tokens=q, running=running, **kw)


def D(url, free=0, running=0, **kw):
    return NodeView(url, "decode", kv_blocks_free=free, running=running, **kw)


def B(url, q=0, free=0, running=0, **kw):
    return NodeView(url, "both", queued_prompt_tokens=q, kv_blocks_free=free, running=running, **kw)


def test_prefill_fewest_queued_tokens_decode_most_free_blocks():
    nodes = [P("p1", q=900), P("p2", q=100), P("p3", q=500), D("d1", free=10), D("d2", free=80), D("d3", free=40)]
    assert pick(nodes) == Route(prefill="p2", decode="d2")


def test_decode_tie_broken_by_least_running():
    nodes = [P("p1"), D("d1", free=50, running=9), D("d2", free=50, running=2)]
    assert pick(nodes).decode == "d2"


def test_not_ready_draining_and_excluded_nodes_are_skipped():
    nodes = [P("p1", q=0, ready=False), P("p2", q=50), P("p3", q=10, draining=True),
             D("d1", free=99), D("d2", free=5)]  # fmt: skip
    assert pick(nodes) == Route(prefill="p2", decode="d1")
    assert pick(nodes, exclude={"d1"}) == Route(prefill="p2", decode="d2")


def test_falls_back_to_both_nodes_without_a_split_pair():
    nodes = [P("p1"), B("b1", q=300), B("b2", q=20)]
    assert pick(nodes) == Route(both="b2")
    assert pick([D("d1", free=9), B("b1")]) == Route(both="b1")


def test_split_preferred_over_both():
    assert pick([B("b1"), P("p1"), D("d1")]).split


def test_nothing_routable():
    assert pick([]) is None
    assert pick([P("p1", ready=False), D("d1")]) is None
    assert pick([B("b1")], exclude={"b1"}) is None


# --- scoring by cache: hit tokens against load (router.prefill_cost) ---------------------------------


def test_a_hit_wins_over_a_lighter_queue_until_the_queue_costs_more_than_the_hit_saves():
    nodes = [B("b1", q=0, free=100), B("b2", q=300, free=100)]
    assert pick(nodes, hits={"b2": 512}, prompt_tokens=600) == Route(both="b2", hit_tokens=512)  # 300 + 88 < 600
    assert pick(nodes, hits={"b2": 256}, prompt_tokens=600) == Route(both="b1", hit_tokens=0)  # 300 + 344 > 600


def test_no_hit_anywhere_is_least_load_and_an_empty_node_just_joined_wins():
    nodes = [B("old", q=40, free=10, running=3), B("new", q=0, free=500)]
    assert pick(nodes, hits={}, prompt_tokens=400) == Route(both="new")
    assert pick(nodes, hits={"old": 0, "new": 0}, prompt_tokens=400).both == "new"


def test_equal_cost_goes_to_the_most_free_kv_blocks():
    assert pick([B("a", free=10), B("b", free=90)], prompt_tokens=100).both == "b"


def test_running_streams_cost_their_weight():
    nodes = [B("a", q=0, running=10), B("b", q=15, running=0)]
    assert pick(nodes, prompt_tokens=100).both == "b"  # 0 + 10 * 2 > 15
    assert pick(nodes, prompt_tokens=100, w=Weights(running=1.0)).both == "a"  # 10 < 15


def test_a_node_without_kv_room_for_the_uncached_part_is_avoided():
    nodes = [B("small", free=2), B("big", q=500, free=400)]
    assert pick(nodes, prompt_tokens=300).both == "big"  # small: 300 tokens need 19 blocks, 2 free
    assert prefill_cost(B("small", free=2), 300, hit=288) == 12  # what is left fits in one block


def test_prefill_role_scored_by_hit_decode_by_free_blocks_and_its_hit():
    nodes = [P("p1", q=0), P("p2", q=100), D("d1", free=50), D("d2", free=45)]
    assert pick(nodes, hits={"p2": 480}, prompt_tokens=500) == Route(prefill="p2", decode="d1", hit_tokens=480)
    assert pick(nodes, hits={"d2": 160}, prompt_tokens=500).decode == "d2"  # 45 + 10 blocks it would not need


def test_a_decode_node_holding_all_but_a_few_tokens_takes_the_whole_request():
    nodes = [P("p1"), D("d1", free=50), D("d2", free=45)]
    assert pick(nodes, hits={"d2": 496}, prompt_tokens=500) == Route(both="d2", hit_tokens=496)  # 4 left: no pull
    assert pick(nodes, hits={"d2": 480}, prompt_tokens=500).split  # 20 left: the prefill node computes them
    assert pick(nodes, hits={"d2": 496}, prompt_tokens=500, w=Weights(local_tokens=0)).split  # turned off
    assert pick(nodes, hits={"p1": 496}, prompt_tokens=500).split  # a prefill node's hit is no reason


def test_weights_are_checked():
    import pytest

    with pytest.raises(ValueError):
        Weights(running=-1)


# ---- peer pull: a node may pull the longest cached prefix from its holder ----------------

PULL = PullCost(fixed_s=0.02, bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
BLOCK = 368_640  # bytes of one 16-token block (SmolLM2, fp32 KV)


def test_pulling_is_worth_it_only_past_the_fixed_cost():
    # 1 block: 20.4 ms to pull vs 16 ms to compute; 2 blocks: 20.7 vs 32
    assert not PULL.worth(1, 16, BLOCK) and PULL.worth(2, 16, BLOCK)
    assert not PULL.worth(0, 16, BLOCK)
    slow_link = PullCost(fixed_s=0.02, bytes_per_s=1e7, prefill_tokens_per_s=1000.0)  # 37 ms a block > 16 ms
    assert not any(slow_link.worth(b, 16, BLOCK) for b in (1, 10, 100))


def test_a_busy_holders_repeat_goes_to_an_idle_node_that_pulls():
    nodes = [B("holder", q=3000, kv_block_bytes=BLOCK), B("new", kv_block_bytes=BLOCK)]
    hits = {"holder": 1488}
    assert pick(nodes, hits=hits, prompt_tokens=1500) == Route(both="new")  # without pulling: all 1,500 computed
    r = pick(nodes, hits=hits, prompt_tokens=1500, pull=PULL)
    assert r == Route(both="new", hit_tokens=0, pull_from="holder", pull_tokens=1488)
    idle = [B("holder", kv_block_bytes=BLOCK), B("new", kv_block_bytes=BLOCK)]
    assert pick(idle, hits=hits, prompt_tokens=1500, pull=PULL) == Route(both="holder", hit_tokens=1488)


def test_no_pull_for_a_short_delta_a_slow_link_or_an_excluded_holder():
    nodes = [B("a", q=400, kv_block_bytes=BLOCK), B("b", q=0, kv_block_bytes=BLOCK)]
    r = pick(nodes, hits={"a": 512, "b": 496}, prompt_tokens=520, pull=PULL)  # 1 block more: computed
    assert r.pull_from is None and r.both == "b"
    slow = PullCost(fixed_s=0.02, bytes_per_s=1e7, prefill_tokens_per_s=1000.0)
    assert pick(nodes, hits={"a": 512}, prompt_tokens=520, pull=slow).pull_from is None
    assert pick(nodes, exclude={"a"}, hits={"a": 512}, prompt_tokens=520, pull=PULL).pull_from is None


def test_a_prefill_node_pulls_from_any_role_holding_the_prefix():
    nodes = [P("p1", q=5000, kv_block_bytes=BLOCK), P("p2", kv_block_bytes=BLOCK), D("d1", free=100)]
    r = pick(nodes, hits={"p1": 800, "d1": 960}, prompt_tokens=1000, pull=PULL)
    assert (r.prefill, r.decode, r.pull_from, r.pull_tokens) == ("p2", "d1", "d1", 960)


def test_a_nodes_own_measured_prefill_rate_decides_over_the_default():
    slow_default = PullCost(fixed_s=0.045, bytes_per_s=0.37e9, prefill_tokens_per_s=200.0)
    # 2 blocks: 47 ms to pull; 160 ms to compute at 200 tokens/s, 16 ms at a measured 2,000
    assert slow_default.worth(2, 16, BLOCK) and not slow_default.worth(2, 16, BLOCK, prefill_tokens_per_s=2000.0)
    nodes = [B("holder", q=5000, kv_block_bytes=BLOCK), B("fast", kv_block_bytes=BLOCK, prefill_tokens_per_s=2000.0)]
    assert pick(nodes, hits={"holder": 64}, prompt_tokens=100, pull=slow_default).pull_from is None  # 4 blocks: 49 ms > 32
    assert pick(nodes, hits={"holder": 960}, prompt_tokens=1000, pull=slow_default).pull_from == "holder"


def test_an_adapters_request_goes_where_it_is_kept_until_that_node_is_busier_than_a_fetch_costs():
    warm = NodeView("http://a", "both", adapters=frozenset({"style@v2"}), prefill_tokens_per_s=1000.0,
                    kv_blocks_free=64)  # fmt: skip
    cold = NodeView("http://b", "both", prefill_tokens_per_s=1000.0, kv_blocks_free=64, adapter_load_s=0.08)
    assert pick([warm, cold], prompt_tokens=20, adapter="style@v2").both == "http://a"
    assert pick([warm, cold], prompt_tokens=20, adapter="style@v1").both == "http://a"  # neither: the url tie-break
    # the fetch costs the cold node 0.08 s x 1000 tokens/s = 80 prefill tokens: a warm queue past that goes there
    busy = NodeView("http://a", "both", adapters=frozenset({"style@v2"}), prefill_tokens_per_s=1000.0,
                    kv_blocks_free=64, queued_prompt_tokens=81)  # fmt: skip
    assert pick([busy, cold], prompt_tokens=20, adapter="style@v2").both == "http://b"
    assert prefill_cost(cold, 20, adapter="style@v2") == 20 + 80 and prefill_cost(cold, 20) == 20  # the base: none
    default = NodeView("http://c", "both")  # nothing measured: the default fetch time at the default prefill rate
    assert prefill_cost(default, 0, adapter="x@v1") == Weights().adapter_load_s * PullCost().prefill_tokens_per_s


def test_a_decode_node_keeping_the_adapter_is_preferred_over_slightly_more_free_blocks():
    p = NodeView("http://p", "prefill", adapters=frozenset({"s@v1"}))
    warm = NodeView("http://d1", "decode", kv_blocks_free=60, adapters=frozenset({"s@v1"}), prefill_tokens_per_s=1000)
    cold = NodeView("http://d2", "decode", kv_blocks_free=62, prefill_tokens_per_s=1000)  # 50 tokens = 3 blocks
    assert pick([p, warm, cold], adapter="s@v1").decode == "http://d1"
    assert pick([p, warm, cold]).decode == "http://d2"  # the base: the most free blocks
    roomy = NodeView("http://d2", "decode", kv_blocks_free=70, prefill_tokens_per_s=1000)
    assert pick([p, warm, roomy], adapter="s@v1").decode == "http://d2"  # a fetch's worth of blocks is bounded
