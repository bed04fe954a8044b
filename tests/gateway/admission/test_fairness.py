"""Admission takes turns between callers (one per API key): a caller that fans out or floods waits behind
itself, not in front of everyone; within one caller, first in first out. The decisions with a fake clock,
then the asyncio hand-offs with callers named by ``CALLER`` as the API key check sets it, then a live gateway
(one request at a time) with two keys over a real node."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import httpx
import pytest

from compute.node.launcher import Services
from gateway.admission.control import CALLER, Admission, AdmissionQueue
from tests.conftest import import_tiny_chat_models
from tests.services import TOKEN, metric, wait_for


def test_a_slot_goes_to_each_waiting_caller_in_turn_and_in_order_within_one():
    q = AdmissionQueue(max_running=1, max_queue=64, timeout_s=60)
    assert q.offer(0.0, "a").started
    flood = [q.offer(0.0, "a") for _ in range(20)]  # one caller's fan-out: n = 20
    b = [q.offer(0.1, "b") for _ in range(2)]
    c = q.offer(0.2, "c")
    assert q.waiting == 23 and q.holds(c) and q.position("d") == 1 + 1 + 1 + 1  # d would start after a, b, c
    order = [q.release(1.0 + i) for i in range(8)]
    assert order == [flood[0], b[0], c, flood[1], b[1], flood[2], flood[3], flood[4]]
    assert all(t.started for t in order) and q.waiting == 15


def test_a_caller_that_leaves_the_queue_gives_up_its_turn():
    q = AdmissionQueue(max_running=1, max_queue=8, timeout_s=60)
    assert q.offer(0.0, "a").started
    a1, b1, a2 = q.offer(0.0, "a"), q.offer(0.0, "b"), q.offer(0.0, "a")
    q.withdraw(b1, 0.5)  # b's client went away: its turn is gone with it
    assert not q.holds(b1) and q.waiting == 2
    assert [q.release(1.0), q.release(2.0)] == [a1, a2]
    assert q.release(3.0) is None and (q.running, q.waiting) == (0, 0)


def test_without_keys_everyone_is_one_caller_first_in_first_out():
    q = AdmissionQueue(max_running=1, max_queue=8, timeout_s=60)
    assert q.offer(0.0).started
    waiting = [q.offer(0.0) for _ in range(5)]
    assert [q.release(float(i)) for i in range(5)] == waiting


def test_asyncio_slots_are_handed_out_in_turn_between_callers():
    async def go() -> list[str]:
        adm = Admission(max_running=1, max_queue=64, timeout_s=30)
        started: list[str] = []
        gate = asyncio.Event()

        async def request(who: str) -> None:
            CALLER.set(who)  # as the API key check sets it for the request's task
            async with adm.slot():
                started.append(who)
                await (gate.wait() if len(started) == 1 else asyncio.sleep(0))

        tasks = [asyncio.create_task(request("flood")) for _ in range(10)]
        await asyncio.sleep(0.01)  # the first runs, nine wait
        tasks.append(asyncio.create_task(request("other")))
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (1, 10)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return started

    started = asyncio.run(go())
    assert started[:3] == ["flood", "flood", "other"] and started.count("flood") == 10


@pytest.mark.slow
def test_through_a_live_gateway_a_second_key_is_served_between_the_firsts_requests(tmp_path_factory, real_model_store):
    """A gateway running one request at a time, two API keys: key A queues six long completions, then key B asks
    once. First in first out, B's answer would come seventh; in turn, it comes second or third."""
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, ("tiny-f",), "fair-store", context=1024)
    services = Services(store.locations, None, str(tmp_path_factory.mktemp("fair")), TOKEN)
    try:
        node = services.node("both", model="tiny-f", extra=("--kernels", "fixed"))
        gw = services.gateway([("both", node)], ("--max-running", "1"), env={"PDSERVE_API_KEYS": "sk-a,sk-b"})
        for p in (node, gw):
            p.wait_ready()
        done: list[str] = []

        def ask(key: str) -> None:
            body = {"model": "tiny-f", "prompt": [5, 6, 7, 8], "max_tokens": 160, "temperature": 0, "ignore_eos": True}
            r = httpx.post(gw.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=120)  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 160
            done.append(key)

        with cf.ThreadPoolExecutor(7) as pool:
            firsts = [pool.submit(ask, "sk-a") for _ in range(6)]
            wait_for(lambda: metric(gw.url, "pdserve_gateway_queue_depth") >= 5, 30, "A's five requests queued")
            assert not done, "the first request ended before the others queued: make it longer"
            second = pool.submit(ask, "sk-b")
            for f in [*firsts, second]:
                f.result(timeout=120)
        assert done.index("sk-b") <= 2, done
    finally:
        services.stop_all()
