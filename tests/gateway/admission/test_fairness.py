"""Admission takes turns between callers (one per API key): a caller that fans out or floods waits behind
itself, not in front of everyone; within one caller, first in first out. The decisions with a fake clock,
then the asyncio hand-offs with callers named by ``CALLER`` as the API key check sets it."""

from __future__ import annotations

import asyncio

from gateway.admission.control import CALLER, Admission, AdmissionQueue


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
                await gate.wait() if len(started) == 1 else asyncio.sleep(0)

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
