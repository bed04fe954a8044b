"""Peer pull between real node processes: a node pulls a prompt prefix's blocks from a
peer's cache over TCP and over NIXL (bytes and blocks counted on the puller, the request's cached_tokens saying so) and answers
exactly as a recompute does under ``kernels = invariant``; a pull that cannot happen — nothing cached to export, an
export aborted before the pull, a holder killed, a handle of other hashes — falls back to computing the prompt, and
the request still answers the same tokens. No node leaks a block or a held offer after any of it."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.services import AUTH, metric, nodes_up, wait_blocks_free

pytestmark = pytest.mark.slow
BS = 16
PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
HOLD = ("--kv-hold-s", "4", "--kv-timeout-s", "2", "--kv-blocks", "256")


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_model_store):
    locations, name = tiny_model_store
    specs = {k: ("both", "tcp", *HOLD) for k in ("a", "b", "c")}
    with nodes_up(tmp_path_factory.mktemp("peer"), locations, name, specs, invariant=True) as up:
        yield up


@pytest.fixture(scope="module")
def nixl_nodes(tmp_path_factory, tiny_model_store):
    """Two `both` nodes whose KV moves over NIXL (UCX on loopback): the only ones that need nixl-cu12."""
    pytest.importorskip("nixl_cu12", reason="nixl-cu12 (extra 'rdma') is not installed")
    specs = {k: ("both", "nixl", *HOLD) for k in ("na", "nb")}
    with nodes_up(tmp_path_factory.mktemp("peer-nixl"), *tiny_model_store, specs, invariant=True) as up:
        yield up


def generate(node, rid: str, ids: list[int], pull: dict | None = None, **params) -> tuple[list[int], int]:
    """A whole request on ``node`` (with a peer's export to pull, if given): (its tokens, its cached_tokens)."""
    body = {"request_id": rid, "prompt_token_ids": ids, "params": PARAMS | params}
    if pull is not None:
        body["pull"] = pull
    toks, cached = [], None
    with httpx.stream("POST", node.url + "/internal/generate", json=body, auth=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            msg = json.loads(line)
            toks += msg["token_ids"]
            cached = msg.get("cached_tokens", cached)
    return toks, cached or 0


def export(node, ids: list[int]) -> httpx.Response:
    return httpx.post(node.url + "/internal/kv/export", json={"prompt_token_ids": ids}, auth=AUTH, timeout=30)


def no_leaks(*nodes) -> None:
    """Every node back to no block in use, none held for a transfer or an export, no request active."""
    loads = wait_blocks_free(list(nodes), timeout=15)
    for n, ld in zip(nodes, loads):
        assert (ld["kv_blocks_used"], ld["kv_blocks_held"], ld["kv_transfers_held"], ld["active_requests"]) == (
            0, 0, 0, 0), (n.name, ld)  # fmt: skip


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_a_node_pulls_a_prefix_from_a_peer_and_answers_as_a_recompute(request, transport):
    up = request.getfixturevalue("nodes" if transport == "tcp" else "nixl_nodes")
    a, b = (up["a"], up["b"]) if transport == "tcp" else (up["na"], up["nb"])
    ids = prompt(1)
    ref, cached = generate(a, "warm", ids)  # computed from scratch on a: its full blocks stay cached there
    assert cached == 0
    r = export(a, ids)
    assert r.status_code == 200, r.text
    kv = r.json()["kv"]
    assert kv["backend"] == transport  # the handle names the transport the pull will run over
    n = (len(ids) - 2) // BS  # 12 blocks: a prompt leaves its last 2 tokens to compute
    assert r.json()["num_blocks"] == n == len(kv["block_hashes"])
    before = b.load()
    bytes0, blocks0 = metric(b, "pdserve_node_peer_pulled_bytes_total"), metric(b, "pdserve_node_peer_pulled_blocks_total")
    wire0 = metric(b, "pdserve_kv_transfer_bytes_total", backend=transport, direction="received")
    got, cached = generate(b, "pulled", ids, pull=kv)
    after = b.load()
    assert got == ref  # invariant kernels: the pulled KV gives the numbers a recompute gives
    assert cached == n * BS
    assert metric(b, "pdserve_node_peer_pulled_blocks_total") - blocks0 == n
    assert metric(b, "pdserve_node_peer_pulled_bytes_total") - bytes0 == kv["nbytes"] > 0
    assert after["prefix_pulled"] - before["prefix_pulled"] == n * BS
    assert after["prefix_hits"] - before["prefix_hits"] == n * BS
    assert after["peer_pull_fallbacks"] == before["peer_pull_fallbacks"]
    assert after["kv_blocks_cached"] >= n  # named on b: its next request hits locally
    assert generate(b, "salted", ids, cache_salt="other")[0] == ref  # a miss on b computes the same tokens
    again, cached = generate(b, "again", ids)
    assert again == ref and cached == n * BS and b.load()["prefix_pulled"] == after["prefix_pulled"]
    assert metric(a, "pdserve_node_peer_exported_blocks_total") >= n
    assert metric(b, "pdserve_kv_transfer_bytes_total", backend=transport, direction="received") > wire0
    no_leaks(a, b)


def test_a_failed_pull_falls_back_to_computing_the_prompt(nodes):
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    r = export(b, prompt(99))  # nothing of it cached on b: refused, the caller pulls from no one
    assert r.status_code == 503 and r.json()["kind"] == "overloaded", r.text
    fallbacks = b.load()["peer_pull_fallbacks"]

    ids = prompt(2)  # an export aborted before its pull: the offer is gone
    ref, _ = generate(a, "warm2", ids)
    kv = export(a, ids).json()["kv"]
    assert httpx.post(a.url + "/internal/abort", json={"request_id": kv["request_id"]}, auth=AUTH).json()["aborted"]
    assert generate(b, "aborted-export", ids, pull=kv) == (ref, 0)

    ids = prompt(3)  # a handle whose hashes are not this prompt's (another salt, model, block size...): not pulled
    ref, _ = generate(a, "warm3", ids)
    bad = dict(export(a, ids).json()["kv"])
    bad["block_hashes"] = ["00" * 32] + bad["block_hashes"][1:]
    assert generate(b, "mismatch", ids, pull=bad) == (ref, 0)
    assert metric(b, "pdserve_node_peer_pull_fallbacks_total", reason="mismatch") >= 1

    ids = prompt(4)  # the holder dies between the export and the pull
    ref, _ = generate(c, "warm4", ids)
    kv = export(c, ids).json()["kv"]
    c.stop()
    assert generate(b, "holder-gone", ids, pull=kv) == (ref, 0)
    assert b.load()["peer_pull_fallbacks"] - fallbacks == 3
    assert metric(b, "pdserve_node_peer_pull_fallbacks_total", reason="transfer_failed") >= 2
    no_leaks(a, b)  # a's export of the mismatch, never pulled, is released at its hold's end (4 s)
