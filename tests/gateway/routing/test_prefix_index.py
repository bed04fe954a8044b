"""The gateway's prefix index as a pure structure: reports folded, matches as the nodes would hit, the
approximate part's TTL on a fake clock, nodes leaving it."""

from __future__ import annotations

from compute.engine.prefix_hash import block_hashes, extra_keys
from compute.node import protocol as P
from gateway.routing.prefix_index import PrefixIndex

BS = 4
EXTRA = extra_keys("tiny@v1/fp32", "float32", BS)
PROMPT = list(range(100, 130))  # 30 tokens: 7 blocks usable (the node leaves >= 2 tokens to compute)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def report(model="m", stored=(), removed=(), seq=1, epoch="e1", **kw) -> P.CacheReport:
    mc = P.ModelCache(block_size=BS, extra=list(EXTRA), cursor=P.CacheCursor(epoch, seq), stored=list(stored),
                      removed=list(removed), **kw)  # fmt: skip
    return P.CacheReport({model: mc})


def test_a_node_holding_the_first_blocks_hits_their_tokens_and_a_gap_ends_the_run():
    hs = block_hashes(PROMPT, BS, EXTRA)
    idx = PrefixIndex()
    idx.apply("a", report(stored=hs[:3]))
    idx.apply("b", report(stored=[hs[0], hs[2], hs[3]]))  # block 1 missing: only block 0 counts
    m = idx.match("m", PROMPT)
    assert m.hits == {"a": 12, "b": 4}
    assert idx.cursors("a") == {"m": P.CacheCursor("e1", 1)}


def test_a_hit_is_capped_as_the_node_caps_it():
    prompt = PROMPT[:16]  # 4 full blocks, but the node computes >= 2 tokens: 3 blocks usable
    idx = PrefixIndex()
    idx.apply("a", report(stored=block_hashes(prompt, BS, EXTRA)))
    assert idx.match("m", prompt).hits == {"a": 12}


def test_removed_cleared_and_resync_reports():
    hs = block_hashes(PROMPT, BS, EXTRA)
    idx = PrefixIndex()
    idx.apply("a", report(stored=hs[:4]))
    idx.apply("a", report(removed=[hs[2]], seq=2))
    assert idx.match("m", PROMPT).hits == {"a": 8}
    idx.apply("a", report(seq=3, cleared=True))
    assert idx.match("m", PROMPT).hits == {"a": 0} and idx.held("a", "m") == set()
    idx.apply("a", report(stored=hs[:1], seq=9, epoch="e2", resync=True))
    assert idx.held("a", "m") == {hs[0]}


def test_a_salted_request_does_not_match_an_unsalted_holder():
    idx = PrefixIndex()
    idx.apply("a", report(stored=block_hashes(PROMPT, BS, EXTRA)))
    assert idx.match("m", PROMPT).hits["a"] == 28
    assert idx.match("m", PROMPT, salt="tenant").hits["a"] == 0
    idx.apply("b", report(stored=block_hashes(PROMPT, BS, EXTRA, "tenant")))
    assert idx.match("m", PROMPT, salt="tenant").hits == {"a": 0, "b": 28}


def test_what_the_gateway_sent_counts_until_the_ttl_or_a_removal():
    clock = Clock()
    idx = PrefixIndex(ttl_s=5.0, clock=clock)
    idx.apply("a", report())
    idx.apply("b", report())
    m = idx.match("m", PROMPT)
    assert m.hits == {"a": 0, "b": 0}
    idx.record(m, "b")
    assert idx.match("m", PROMPT).hits == {"a": 0, "b": 28}
    clock.t += 4.9
    assert idx.match("m", PROMPT).hits["b"] == 28
    clock.t += 0.2
    assert idx.match("m", PROMPT).hits["b"] == 0  # expired
    idx.record(idx.match("m", PROMPT), "b")
    idx.apply("b", report(removed=block_hashes(PROMPT, BS, EXTRA)[3:4], seq=2))  # the node says block 3 is gone
    assert idx.match("m", PROMPT).hits["b"] == 12


def test_a_node_that_leaves_or_drops_a_model_leaves_the_index():
    hs = block_hashes(PROMPT, BS, EXTRA)
    idx = PrefixIndex()
    idx.apply("a", report(stored=hs))
    idx.apply("b", report(stored=hs))
    idx.record(idx.match("m", PROMPT), "a")
    idx.forget("a")
    assert idx.match("m", PROMPT).hits == {"b": 28} and "a" not in idx.nodes()
    idx.apply("b", P.CacheReport({}))  # the model is no longer ready on b (draining, unloaded)
    assert idx.match("m", PROMPT).hits == {} and idx.held("b", "m") == set()


def test_nodes_of_another_block_size_or_without_a_cache():
    idx = PrefixIndex()
    other = extra_keys("tiny@v1/fp32", "float32", 8)
    mc = P.ModelCache(block_size=8, extra=list(other), cursor=P.CacheCursor("x", 1),
                      stored=block_hashes(PROMPT, 8, other))  # fmt: skip
    idx.apply("eight", P.CacheReport({"m": mc}))
    idx.apply("off", report(enabled=False))
    idx.apply("four", report(stored=block_hashes(PROMPT, BS, EXTRA)[:2]))
    assert idx.match("m", PROMPT).hits == {"eight": 24, "four": 8}
    assert idx.block_sizes("m") == {"eight": 8, "off": 4, "four": 4}
