"""Stop strings over streamed text, and admission control's bounds and deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission.control import Admission, Overloaded
from gateway.api.stops import StopMatcher


def run_stream(stops, pieces):
    m = StopMatcher(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, out


@pytest.mark.parametrize(
    "stops,pieces,want,hit",
    [
        (["\n\n"], ["Hello", " world", "\n", "\nmore"], "Hello world", True),
        (["END"], ["abc E", "N", "D tail"], "abc ", True),
        (["END"], ["abc E", "N", "x"], "abc ENx", False),
        (["ab", "xyz"], ["...x", "y", "z!"], "...", True),
        ([], ["a", "b"], "ab", False),
        (["stop"], ["nostop"], "no", True),
    ],
)
def test_stop_strings(stops, pieces, want, hit):
    text, got_hit, _ = run_stream(stops, pieces)
    assert (text, got_hit) == (want, hit)


def test_partial_stop_prefix_is_held_back_not_lost():
    _, _, out = run_stream(["END"], ["abc E", "N", "x"])
    assert out[0] == "abc " and out[-1] == ""  # "E", "EN" held, released with "x"
    assert "".join(out) == "abc ENx"


def test_admission_bounds_queue_and_deadline():
    async def main():
        adm = Admission(max_running=1, max_queue=1, timeout_s=0.2)
        entered = asyncio.Event()
        release = asyncio.Event()

        async def holder():
            async with adm.slot():
                entered.set()
                await release.wait()

        h = asyncio.create_task(holder())
        await entered.wait()
        t0 = time.monotonic()
        waiter = asyncio.create_task(_try(adm))
        await _yield_until(lambda: adm.waiting == 1)
        with pytest.raises(Overloaded, match="queue full"):  # one running, one waiting: the third is refused
            async with adm.slot():
                pass
        assert isinstance(await waiter, Overloaded)  # the waiter hit its deadline
        queued_s = time.monotonic() - t0  # the control, in this run: a wait that ran out its deadline
        release.set()
        await h
        async with adm.slot() as waited:  # a free slot: taken without waiting
            assert waited < queued_s / 10 and adm.running == 1
        assert adm.running == 0 and adm.waiting == 0

    asyncio.run(main())


async def _yield_until(cond, tries: int = 1000) -> None:
    """Let the other tasks run (no sleeping: no window to guess) until ``cond()``; bounded."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0)
    assert cond()


async def _try(adm):
    try:
        async with adm.slot():
            return None
    except Overloaded as e:
        return e


def test_a_burst_fills_free_slots_before_the_queue():
    """16 arrivals at once, 8 slots, 4 queue places: 8 run, 4 wait, exactly 4 are refused."""

    async def main():
        adm = Admission(max_running=8, max_queue=4, timeout_s=5)
        gate = asyncio.Event()

        async def req():
            try:
                async with adm.slot():
                    await gate.wait()
                    return "ok"
            except Overloaded:
                return "refused"

        tasks = [asyncio.create_task(req()) for _ in range(16)]
        await _yield_until(lambda: sum(t.done() for t in tasks) == 4)  # the refused ones are done at once
        assert (adm.running, adm.waiting) == (8, 4)
        gate.set()
        return sorted(await asyncio.gather(*tasks))

    assert asyncio.run(main()) == ["ok"] * 12 + ["refused"] * 4
