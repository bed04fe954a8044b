"""Admission bounds the wait before a request starts: the decisions stepped with a fake clock,
asyncio hand-offs and cancellation, and real overload through the real `openai` client."""

from __future__ import annotations

import asyncio
import heapq
import math
import time

import pytest

from gateway.admission.control import (
    DRAIN_SAMPLES,
    DRAIN_WINDOW_S,
    Admission,
    AdmissionQueue,
    Overloaded,
)


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
    assert len(accepted) == 10 and not any(t.started for t in accepted)
    with pytest.raises(Overloaded, match="predicted wait 11.0 s") as e:
        q.offer(2.0)  # position 11: 11 s > 10 s, refused now (the clock still at 2.0) rather than after 10 s of waiting
    assert (q.running, q.waiting) == (1, 10)  # the refused one never queued: nothing of it waits for the deadline
    assert e.value.retry_after == 10  # ceil(10 waiting / 1 per s), capped at the bound
    assert q.release(3.0) is accepted[0]  # the queue goes on as before, first in first out


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


# --- real overload: real nodes and model, real HTTP, the real `openai` client ------------------------
STREAM = dict(messages=[{"role": "user", "content": "Count from one to fifty."}], max_tokens=8, temperature=0,
              stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip


@pytest.fixture(scope="module")
def overload_nodes(tmp_path_factory, real_model_store):
    """A prefill and a decode node on the real model, ready, each on its final kernel plan (the default measured
    one): the test's bounds come from a control stream timed first, which holds only if no background
    measurement runs and no plan is swapped in between the control and the burst. -> (tmp, locations, name,
    [(role, node)])."""
    from tests.services import nodes_up, wait_kernels_settled

    locations, name = real_model_store
    tmp = tmp_path_factory.mktemp("overload")
    with nodes_up(tmp, locations, name, {role: (role, "tcp") for role in ("prefill", "decode")}) as nodes:
        wait_kernels_settled(list(nodes.values()))
        yield tmp, locations, name, list(nodes.items())


def _stream_one(openai, client, model: str):
    async def one() -> dict:
        t0 = time.monotonic()
        try:
            stream = await client.chat.completions.create(model=model, **STREAM)
            ttft, usage, reason = None, None, None
            async for ch in stream:
                ttft = ttft if ttft is not None else time.monotonic() - t0
                if ch.choices and ch.choices[0].finish_reason:
                    reason = ch.choices[0].finish_reason
                usage = ch.usage or usage
            return {"status": 200, "ttft": ttft, "tokens": usage.completion_tokens, "reason": reason,
                    "took": time.monotonic() - t0}  # fmt: skip
        except openai.RateLimitError as e:
            err = e.response.json()["error"]
            return {"status": 429, "took": time.monotonic() - t0, "retry_after": int(e.response.headers["retry-after"]),
                    "message": err["message"], "type": err["type"]}  # fmt: skip

    return one


def _run_waves(openai, url: str, model: str, plan) -> list:
    """Run `plan(wave)` (a coroutine function given `wave(n)` -> results of n concurrent streams)."""

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        one = _stream_one(openai, client, model)
        try:
            return await plan(lambda n: asyncio.gather(*(one() for _ in range(n))))
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.mark.slow
def test_overload_refuses_early_with_retry_after_and_completes_every_accepted_stream(overload_nodes):
    """2 slots, a queue of 64 and a bound of 4 streams' time (one stream measured first, through a
    gateway with the defaults, on the same nodes). A warm-up lets the gateway measure its drain rate,
    then a burst of 3x what can start within the bound at that rate. Every stream that starts completes;
    the surplus gets 429 + Retry-After, mostly on arrival (position / rate > bound), and nobody waits
    much past the bound."""
    openai = pytest.importorskip("openai")
    import httpx

    from tests.services import start_gateway

    tmp, locations, name, nodes = overload_nodes
    gw = start_gateway(tmp, locations, name, nodes)
    try:
        gw.wait_ready()
        (control,) = _run_waves(openai, gw.url, name, lambda wave: wave(1))
    finally:
        gw.stop()
    assert control["status"] == 200 and control["tokens"] == 8
    bound = max(2.0, 4 * control["took"])
    gw = start_gateway(tmp, locations, name, nodes, ("--max-running", "2", "--max-queue", "64",
                                                     "--queue-timeout", f"{bound:.2f}"))  # fmt: skip
    try:
        gw.wait_ready()

        async def plan(wave):
            warm = await wave(4)  # 2 run, 2 wait and are handed slots: the gateway measures its drain rate
            rate = httpx.get(gw.url + "/load").json()["drain_rate_per_s"]
            n = min(200, 3 * (2 + math.ceil(bound * rate)))  # 3x what can start within the bound
            t0 = time.monotonic()
            burst = await wave(n)
            return warm, rate, n, burst, time.monotonic() - t0

        warm, rate, n, burst, wall = _run_waves(openai, gw.url, name, plan)
        load = httpx.get(gw.url + "/load").json()
    finally:
        gw.stop()
    assert [r["status"] for r in warm] == [200] * 4, warm
    assert rate is not None and rate > 0
    ok = [r for r in burst if r["status"] == 200]
    refused = [r for r in burst if r["status"] == 429]
    assert len(ok) + len(refused) == n and len(ok) >= 2, burst
    # nothing accepted is lost: every started stream ran to its full length
    assert all(r["tokens"] == 8 and r["reason"] == "length" for r in ok), ok
    # the surplus is refused, with a Retry-After from the drain rate (1 s .. the bound)
    assert len(refused) >= n // 3, (rate, n, [r["status"] for r in burst])
    assert all(r["type"] == "rate_limit_error" and 1 <= r["retry_after"] <= math.ceil(bound) for r in refused)
    early = [r for r in refused if "predicted wait" in r["message"]]
    late = [r for r in refused if "no capacity within" in r["message"]]
    print(f"overload: one stream {control['took']:.2f} s, bound {bound:.2f} s, drain {rate:.2f}/s, burst {n}: "
          f"{len(ok)} ok, {len(early)} refused on arrival, {len(late)} at the deadline, wall {wall:.2f} s, "
          f"Retry-After {sorted({r['retry_after'] for r in refused})}")  # fmt: skip
    assert len(early) + len(late) == len(refused)  # the queue (64) never filled: memory stays bounded below it
    assert len(early) > len(late), [(r["message"], round(r["took"], 2)) for r in refused]
    assert all(r["took"] < bound / 2 for r in early)  # refused on arrival, not after waiting
    # the wait before the start is bounded: first token within the bound plus one stream's time
    slowest = max(r["took"] for r in warm)
    assert all(r["ttft"] <= bound + slowest for r in ok), ([round(r["ttft"], 2) for r in ok], bound)
    assert all(r["took"] <= bound + slowest for r in late)
    assert wall <= bound + 2 * slowest + 1, (wall, bound, slowest)
    assert load["queue_depth"] == 0 and load["running"] == 0
