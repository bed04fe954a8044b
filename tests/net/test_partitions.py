"""Partitions between machines, not kills on loopback: the gateway and the nodes each on its own host (a network
namespace, tests/net/lab.py), with black holes and flapping links while requests run.

Across a partition nothing is refused: a connect hangs, an open stream goes silent. What must hold:
- a black hole between the gateway and a node: every stream running there finishes on the other node with the answer
  it had begun (greedy, int8 weights on ``kernels = invariant``: a resumed stream continues bit for bit), in seconds,
  not after the gateway's 60 s silence limit (detection: TCP keepalive on the gateway's node connections,
  compute/node/client.py); the node is out of routing within two failed health polls and every new request answers
  from the other; healed, it answers a new challenge before anything is routed to it again, then serves;
- a black hole between a prefill node and one decode node: a request handed there cannot pull its KV (the connect
  hangs), fails after the transfer timeout and is retried; healed and past the hold time, no KV block stays held on
  any node (the transfer is cut before its first byte here: the tiny model's KV moves in milliseconds);
- two gateways over the same nodes, one of them cut from a node: two views of the pool, each answering unchanged;
  healed, they agree again;
- a KV transfer cut mid-way (the prefill host's link rate-limited so that it lasts seconds, then black-holed to the
  importing decode node): retried, answered unchanged, nothing left used, held or importing on either side;
- a link flapping every second: no request lost or changed, no block or request left on either node.

The real model, not the tiny random one: on the tiny model one prompt's greedy answer flipped between two tokens
from run to run, with or without a fault (reproduced on loopback with kill -9 and with no fault at all: a near-tie
that ``kernels = invariant`` does not hold bit for bit there; left open, not a partition effect).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time

import httpx
import pytest

from compute.node.launcher import Services
from tests.net.lab import NetLab
from tests.services import TOKEN, metric, wait_blocks_free, wait_kernels_settled

pytestmark = [pytest.mark.long, pytest.mark.skipif(NetLab.why_not() is not None, reason=str(NetLab.why_not()))]
MODEL = "smollm2"  # the real model (real_model_store): the tiny random one has near-ties that flip (see above)
KEY = "sk-net-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TOKENS = 64  # a stream still running when the partition starts (seconds with 8 at once)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, real_model_store):
    locations, _ = real_model_store
    lab = NetLab()
    services = Services(locations, None, str(tmp_path_factory.mktemp("net")), TOKEN)
    try:
        g, a, b = lab.host(), lab.host(), lab.host()
        flags = ("--step", "eager", "--kernels", "invariant")
        na = services.node("both", kv_blocks=512, model=MODEL, extra=flags, on=a)
        nb = services.node("both", kv_blocks=512, model=MODEL, extra=flags, on=b)
        gw = services.gateway([("both", na), ("both", nb)], env={"PDSERVE_API_KEYS": KEY}, on=g)
        for p in (na, nb, gw):
            p.wait_ready()
        wait_kernels_settled([na, nb])  # one plan on both, kept from the first request (tests/services.py)
        yield {"lab": lab, "hosts": (g, a, b), "nodes": (na, nb), "gw": gw, "services": services}
    finally:
        services.stop_all()
        lab.close()


def _states(gw) -> dict[str, str]:
    r = httpx.get(gw.url + "/admin/nodes", headers=gw.admin_headers, timeout=10)
    return {n["url"]: n["state"] for n in r.json()["nodes"]}


def _wait_state(gw, url: str, want: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _states(gw).get(url) == want:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{url} not {want} in {timeout} s: {_states(gw)}")


def _complete(gw, ids: list[int], started=None, **extra) -> tuple[str, float]:
    """A streamed greedy completion's text and seconds; ``started`` (an Event) set at its first token; ``extra``:
    more of the request's fields."""
    t0, text = time.monotonic(), []
    with httpx.stream("POST", gw.url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": MODEL, "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                            "stream": True, **extra}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                msg = json.loads(line[6:])
                assert "error" not in msg, msg["error"]
                text.append(msg["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(text), time.monotonic() - t0


def _differences(got: list[str], want: list[str]) -> list[tuple[int, int, str, str]]:
    """(request, first differing character, what came, what was wanted there) of each answer that differs."""
    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append((i, at, a[at : at + 30], b[at : at + 30]))
    return out


def _finished(node) -> float:
    """Requests whose output ended on ``node`` (its metrics)."""
    return metric(node, "pdserve_node_requests_finished_total")


def test_a_black_hole_between_the_gateway_and_a_node(pool):
    lab, (g, a, _), (na, _), gw = pool["lab"], pool["hosts"], pool["nodes"], pool["gw"]
    rng = random.Random(39)
    prompts = [rng.choices(range(200, 40000), k=24) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        want = list(ex.map(lambda p: _complete(gw, p)[0], prompts))  # the answers, unpartitioned
        started = [threading.Event() for _ in prompts]
        running = [ex.submit(_complete, gw, p, s) for p, s in zip(prompts, started)]
        assert all(s.wait(60) for s in started)
        on_a = na.load()["active_requests"]
        t_hole = time.monotonic()
        lab.black_hole(a, g)
        got = [f.result(timeout=120) for f in running]
    assert on_a > 0, "no stream ran on the node partitioned"
    assert [text for text, _ in got] == want, _differences([text for text, _ in got], want)  # finished on the other, unchanged
    late = time.monotonic() - t_hole  # every stream ended by now
    print(f"partition -> every stream ended: {late:.1f} s")
    assert late < 15, f"the streams ended {late:.1f} s after the partition: detection waited for a silence limit"
    _wait_state(gw, na.url, "unproven", 10)  # out of routing (already, or within two polls)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:  # new requests while partitioned: all answered by b
        assert list(ex.map(lambda p: _complete(gw, p)[0], prompts[:4])) == want[:4]
    lab.heal()
    _wait_state(gw, na.url, "ready", 20)  # proven again (the registry challenges an unproven node before routing)
    before = _finished(na)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert list(ex.map(lambda p: _complete(gw, p)[0], prompts)) == want
    assert _finished(na) > before  # it serves again

@pytest.fixture(scope="module", params=["tcp", "nixl"])
def split(request, tmp_path_factory, real_model_store):
    """A prefill node and two decode nodes, each on its own host, behind a gateway on a fourth; KV held 8 s for
    the decode side, a transfer failed after 4 s (the defaults are 30 and 10: a shorter drill, the same rule). The KV
    moves over the plain TCP transport, or NIXL with UCX on TCP over the hosts' links (UCX would otherwise read
    another process's memory directly on one machine, which no partition cuts)."""
    transport, env = request.param, {}
    if transport == "nixl":
        pytest.importorskip("nixl_cu12")
        env = {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp"}
    locations, _ = real_model_store
    lab = NetLab()
    services = Services(locations, None, str(tmp_path_factory.mktemp("net-split")), TOKEN, env=env)
    try:
        g, p, d1, d2 = (lab.host() for _ in range(4))
        flags = ("--step", "eager", "--kernels", "invariant", "--kv-hold-s", "8", "--kv-timeout-s", "4",
                 "--kv-transport", transport)  # fmt: skip
        nodes = [services.node(role, kv_blocks=512, model=MODEL, extra=flags, on=h)
                 for role, h in (("prefill", p), ("decode", d1), ("decode", d2))]  # fmt: skip
        gw = services.gateway([(role, n) for role, n in zip(("prefill", "decode", "decode"), nodes)],
                              env={"PDSERVE_API_KEYS": KEY}, on=g)  # fmt: skip
        for n in (*nodes, gw):
            n.wait_ready()
        assert {n.load()["kv_transport"] for n in nodes} == {transport}  # not a fallback
        wait_kernels_settled(nodes)
        yield {"lab": lab, "hosts": (g, p, d1, d2), "nodes": nodes, "gw": gw}
    finally:
        services.stop_all()
        lab.close()


def test_a_black_hole_between_prefill_and_one_decode_node(split):
    """Prefill reaches one decode node no more (both still reach the gateway): a request handed to that node
    cannot pull its KV (the connect hangs), fails after the transfer timeout and is retried; every answer is the
    unpartitioned one, and once healed and past the hold time no KV block stays held on any node."""
    lab, (_, p, d1, _), nodes, gw = split["lab"], split["hosts"], split["nodes"], split["gw"]
    rng = random.Random(40)
    prompts = [rng.choices(range(200, 40000), k=300) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        want = list(ex.map(lambda q: _complete(gw, q)[0], prompts))
        lab.black_hole(p, d1)
        t0 = time.monotonic()
        got = list(ex.map(lambda q: _complete(gw, q)[0], prompts))
        took = time.monotonic() - t0
    print(f"8 requests across the prefill/decode partition: {took:.1f} s")
    assert got == want, _differences(got, want)
    lab.heal()
    loads = wait_blocks_free(nodes, timeout=20)  # the prefill side's holds expire (8 s); nothing leaks either side
    assert [ld["kv_blocks_used"] for ld in loads] == [0, 0, 0], loads
    with concurrent.futures.ThreadPoolExecutor(8) as ex:  # healed: both decode nodes serve again
        again = list(ex.map(lambda q: _complete(gw, q)[0], prompts))
    assert again == want, _differences(again, want)


def test_two_gateways_see_the_pool_differently_across_a_partition_and_agree_once_healed(pool):
    """A second gateway on its own host over the same two nodes; node a black-holed from the first gateway only:
    the first routes everything to b, the second still to both (two views of one pool, each answering every
    request unchanged); healed, the first proves a again and both list both nodes ready."""
    lab, (g, a, _), (na, nb), gw, services = pool["lab"], pool["hosts"], pool["nodes"], pool["gw"], pool["services"]
    g2 = lab.host()
    gw2 = services.gateway([("both", na), ("both", nb)], env={"PDSERVE_API_KEYS": KEY}, on=g2)
    try:
        gw2.wait_ready()
        rng = random.Random(43)
        prompts = [rng.choices(range(200, 40000), k=24) for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            want = list(ex.map(lambda q: _complete(gw, q)[0], prompts))
            lab.black_hole(a, g)
            _wait_state(gw, na.url, "unproven", 15)
            assert _states(gw2) == {na.url: "ready", nb.url: "ready"}  # the other view: a serves there
            before = _finished(na), _finished(nb)
            assert list(ex.map(lambda q: _complete(gw, q)[0], prompts)) == want  # all on b
            assert _finished(na) == before[0] and _finished(nb) - before[1] == len(prompts)
            assert list(ex.map(lambda q: _complete(gw2, q)[0], prompts)) == want  # both serve for the second
            assert _finished(na) > before[0]
            lab.heal()
            _wait_state(gw, na.url, "ready", 20)
        assert _states(gw) == _states(gw2) == {na.url: "ready", nb.url: "ready"}
    finally:
        lab.heal()
        services.stop([gw2])


def test_a_kv_transfer_cut_midway_is_retried_and_leaks_no_block(split):
    """The prefill host's sends limited to 160 Mbit/s, so that a 1,500-token prompt's KV (~35 MB) takes ~2 s to
    move (under the drill's 4 s transfer timeout: the timeout bounds a whole transfer, so a slower link fails every
    attempt); once a decode node is importing it, the link between them is black-holed: that transfer stops
    mid-way, fails at the transfer timeout, the request is retried and answers as unpartitioned; healed and past the
    hold time, no block is used or held and no import or transfer is left on any node."""
    lab, (_, p, d1, d2), nodes, gw = split["lab"], split["hosts"], split["nodes"], split["gw"]
    prompt = random.Random(42).choices(range(200, 40000), k=1500)
    want = _complete(gw, prompt, cache_salt="want")[0]  # salted: no node may serve the next one from its cache
    fails = [metric(n, "pdserve_kv_transfer_failures_total") for n in nodes]
    lab.throttle(p, 160)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            running = ex.submit(_complete, gw, prompt)
            t0, importing = time.monotonic(), None
            while importing is None and time.monotonic() - t0 < 60 and not running.done():
                importing = next((i for i, n in enumerate(nodes[1:], 1) if n.load()["importing"]), None)
                time.sleep(0.05)
            assert importing is not None, "no decode node was seen importing the KV"
            time.sleep(0.3)  # into the transfer: ~2 s at this rate
            moving = nodes[importing].load()["importing"]
            lab.black_hole(p, (d1, d2)[importing - 1])
            got = running.result(timeout=120)[0]
    finally:
        lab.heal()
        lab.unthrottle(p)
    assert moving, "the transfer ended before the cut"
    assert got == want, _differences([got], [want])
    after = [metric(n, "pdserve_kv_transfer_failures_total") for n in nodes]
    assert after[importing] > fails[importing], (fails, after)  # cut mid-way, seen failed by the receiver
    loads = wait_blocks_free(nodes, timeout=30)
    assert [(ld["kv_blocks_used"], ld["importing"], ld["kv_transfers_held"]) for ld in loads] == [(0, 0, 0)] * 3, loads


def test_a_flapping_link_loses_no_request_and_leaks_no_block(pool):
    """Node a's link goes down and up every second while 8 streams run and 8 more arrive: every answer is the
    unpartitioned one, and afterwards neither node holds a KV block or a request."""
    lab, (_, a, _), nodes, gw = pool["lab"], pool["hosts"], pool["nodes"], pool["gw"]
    rng = random.Random(41)
    prompts = [rng.choices(range(200, 40000), k=24) for _ in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        want = list(ex.map(lambda q: _complete(gw, q)[0], prompts))
        running = [ex.submit(_complete, gw, q) for q in prompts[:8]]
        for i in range(6):
            lab.cut(a)
            time.sleep(1.0)
            lab.heal()
            time.sleep(1.0)
            if i == 1:
                running += [ex.submit(_complete, gw, q) for q in prompts[8:]]
        got = [f.result(timeout=180)[0] for f in running]
    assert got == want, [i for i, (x, y) in enumerate(zip(got, want)) if x != y]
    _wait_state(gw, nodes[0].url, "ready", 20)
    loads = wait_blocks_free(list(nodes), timeout=20)
    assert [(ld["kv_blocks_used"], ld["active_requests"]) for ld in loads] == [(0, 0), (0, 0)], loads
