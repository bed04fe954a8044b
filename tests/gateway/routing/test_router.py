"""The routing policy is a pure function: tables of node loads -> the route it must pick."""

from __future__ import annotations

from gateway.routing.router import NodeView, Route, pick


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
