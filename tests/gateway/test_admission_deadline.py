"""Admission bounds the wait before a request starts: the decisions stepped with a fake clock,
asyncio hand-offs and cancellation, and real overload through the real `openai` client."""

from __future__ import annotations

import asyncio
import heapq
import math
import time

import pytest

from gateway.admission import DRAIN_SAMPLES, DRAIN_WINDOW_S, Admission, AdmissionQueue, Overloaded


def saturated(q: AdmissionQueue, now: float, waiting: int) -> list:
    """Fill every slot, then `waiting` places in the queue; -> the waiting tickets."""
    for _ in range(q.max_running - q.running):
        assert q.offer(now).started
    return [q.offer(now) for _ in range(waiting)]


def test_free_slot_starts_at_once_and_a_full_queue_refuses():
    q = AdmissionQueue(max_running=2, max_queue=3, timeout_s=10)
    assert q.offer(0.0).started and q.offer(0.0).started
    waiting = [q.offer(0.0) for _ in range(3)]
    assert not any(t.started for t in waiting) and (q.running, q.waiting) == (2, 3)
    with pytest.raises(Overloaded, match="queue full") as e:
        q.offer(0.0)
    assert e.value.retry_after == 10  # nothing has drained yet: rate unknown -> the bound itself
    assert q.release(1.0) is waiting[0] and waiting[0].started  # first in, first out
    assert (q.running, q.waiting) == (2, 2)


def test_drain_rate_is_handoffs_per_busy_second():
    q = AdmissionQueue(max_running=2, max_queue=100, timeout_s=30)
    saturated(q, 0.0, 6)
    assert q.drain_rate(0.0) is None
    for i in range(1, 5):  # one hand-off every 0.5 s
        q.release(i * 0.5)
    assert q.drain_rate(2.0) == pytest.approx(2.0)
    assert q.predicted_wait(3, 2.0) == pytest.approx(1.5)  # position / rate
    assert q.drain_rate(3.0) == pytest.approx(4 / 3.0)  # the open stretch since the last hand-off counts
    assert q.retry_after(3.0) == math.ceil(2 / (4 / 3.0))  # ceil(waiting / rate)


def test_idle_time_is_not_drain_time():
    """Time with nobody waiting does not dilute the rate: only busy stretches count."""
    q = AdmissionQueue(max_running=1, max_queue=10, timeout_s=30)
    saturated(q, 0.0, 1)
    q.release(1.0)  # hand-off after 1 busy second; the queue is empty again
    q.release(1.5)  # slot back to the pool
    assert q.drain_rate(20.0) == pytest.approx(1.0)


def test_early_refusal_when_the_queue_ahead_cannot_drain_in_time():
    q = AdmissionQueue(max_running=1, max_queue=1000, timeout_s=10)
    saturated(q, 0.0, 2)
    q.release(1.0)
    q.release(2.0)  # 1 hand-off per second measured; nobody waits now
    assert q.drain_rate(2.0) == pytest.approx(1.0)
    accepted = [q.offer(2.0) for _ in range(10)]  # position 10: predicted 10 s, within the bound
    assert len(accepted) == 10
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match="predicted wait 11.0 s") as e:
        q.offer(2.0)  # position 11: 11 s > 10 s, refused now rather than after 10 s of waiting
    assert time.monotonic() - t0 < 1.0 and q.waiting == 10
    assert e.value.retry_after == 10  # ceil(10 waiting / 1 per s), capped at the bound


def test_unknown_rate_waits_until_the_deadline():
    q = AdmissionQueue(max_running=1, max_queue=5, timeout_s=4)
    (t,) = saturated(q, 0.0, 1)
    assert t.deadline == 4.0
    err = q.expired(t, 4.0)
    assert isinstance(err, Overloaded) and err.retry_after == 4 and q.waiting == 0


def test_a_stalled_queue_drives_the_rate_down():
    q = AdmissionQueue(max_running=1, max_queue=100, timeout_s=10)
    ws = saturated(q, 0.0, 3)
    q.release(0.5)
    q.release(1.0)  # 2 per second, one left waiting
    assert q.drain_rate(1.0) == pytest.approx(2.0)
    q.expired(ws[2], 11.0)  # nothing drained for 10 s: the queue emptied by the deadline
    assert q.drain_rate(11.0) == pytest.approx(2 / 11.0)
    q.offer(11.0)
    with pytest.raises(Overloaded, match="cannot start within"):
        q.offer(11.0)  # position 2 / (2/11 per s) = 11 s > 10 s


def test_old_samples_leave_the_window():
    q = AdmissionQueue(max_running=1, max_queue=10, timeout_s=10)
    saturated(q, 0.0, 1)
    q.release(1.0)
    assert q.drain_rate(1.0 + DRAIN_WINDOW_S - 0.1) is not None
    assert q.drain_rate(1.0 + DRAIN_WINDOW_S + 0.1) is None


def simulate(offered_x: float, duration_s: float = 60.0, max_running: int = 4, max_queue: int = 500,
             timeout_s: float = 5.0, service_s: float = 1.0) -> dict:  # fmt: skip
    """A discrete-event run on a fake clock: arrivals at `offered_x` times capacity, each started request
    holding its slot `service_s`; returns counts, the longest wait and the largest queue seen."""
    q = AdmissionQueue(max_running, max_queue, timeout_s)
    capacity = max_running / service_s
    gap = 1.0 / (capacity * offered_x)
    events: list = []  # (time, order, kind, ticket)
    seq = 0

    def push(t, kind, ticket=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, ticket))

    def start(t, ticket):
        waits.append(t - ticket.arrived)
        push(t + service_s, "done", ticket)

    for i in range(int(duration_s / gap)):
        push(i * gap, "arrive")
    out = {"started": 0, "done": 0, "refused_now": 0, "expired": 0, "max_waiting": 0, "max_waiting_late": 0,
           "expired_late": 0}  # late: after the first `timeout_s`, once a drain rate has been measured
    waits: list[float] = []
    while events:
        now, _, kind, ticket = heapq.heappop(events)
        if kind == "arrive":
            try:
                t = q.offer(now)
            except Overloaded as e:
                assert 1 <= e.retry_after <= math.ceil(timeout_s)
                out["refused_now"] += 1
                continue
            if t.started:
                start(now, t)
            else:
                push(t.deadline, "deadline", t)
        elif kind == "done":
            out["done"] += 1
            nxt = q.release(now)
            if nxt is not None:
                start(now, nxt)
        elif kind == "deadline" and not ticket.started:
            q.expired(ticket, now)
            out["expired"] += 1
            out["expired_late"] += ticket.arrived > timeout_s
        out["max_waiting"] = max(out["max_waiting"], q.waiting)
        if now > timeout_s:
            out["max_waiting_late"] = max(out["max_waiting_late"], q.waiting)
        assert len(q._samples) <= DRAIN_SAMPLES
    out["started"] = len(waits)
    out["max_wait"] = max(waits)
    out["capacity"] = capacity
    return out


def test_ten_times_overload_bounds_wait_and_queue_and_loses_nothing_accepted():
    r = simulate(offered_x=10.0)
    assert r["done"] == r["started"]  # every started request completed
    assert r["max_wait"] <= 5.0 + 1e-9  # nobody started after waiting past the bound
    assert r["max_waiting"] <= 500  # the first burst, before anything drained, is bounded by max_queue
    # once the rate is measured the queue holds what drains within the bound (capacity x timeout = 20)
    assert r["max_waiting_late"] <= 20 + 1, r
    # ... and the surplus is refused on arrival, not after waiting 5 s
    assert r["expired_late"] == 0 and r["expired"] < r["max_waiting"], r
    assert r["refused_now"] > 8 * r["started"], r  # 10x offered: ~90% refused
    assert r["started"] >= 0.9 * r["capacity"] * 60, r  # and the service still runs at capacity


def test_under_capacity_nobody_is_refused():
    r = simulate(offered_x=0.9)
    assert r["refused_now"] == r["expired"] == 0 and r["done"] == r["started"]


# --- asyncio: hand-offs, cancellation ---------------------------------------------------------------
def test_cancelled_waiter_leaves_the_queue_and_slot_goes_to_the_next():
    async def main():
        adm = Admission(max_running=1, max_queue=4, timeout_s=5)
        gate, order = asyncio.Event(), []

        async def req(name):
            async with adm.slot():
                order.append(name)
                await gate.wait()

        tasks = {n: asyncio.create_task(req(n)) for n in "abc"}
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (1, 2)
        tasks["b"].cancel()
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        gate.set()
        await asyncio.gather(tasks["a"], tasks["c"])
        assert order == ["a", "c"] and (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_waiter_cancelled_just_as_it_is_handed_the_slot_passes_it_on():
    async def main():
        adm = Admission(max_running=1, max_queue=4, timeout_s=5)
        hold = adm.slot()
        await hold.__aenter__()
        b = asyncio.create_task(_enter_and_exit(adm))
        c = asyncio.create_task(_enter_and_exit(adm))
        await asyncio.sleep(0.01)
        await hold.__aexit__(None, None, None)  # hands the slot to b ...
        b.cancel()  # ... which is cancelled before it runs
        assert await c == "ran"
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


async def _enter_and_exit(adm):
    async with adm.slot():
        return "ran"
