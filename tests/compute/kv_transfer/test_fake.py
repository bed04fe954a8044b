"""The in-process fake: same contract, no network; the 200-request leak loop."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import torch

from compute.kv_transfer import (
    KVPool,
    TransferFailed,
    TransferState,
    make_transfer,
    wait,
)
from tests.compute.kv_transfer.conftest import DST_BLOCKS, NUM_TOKENS, SRC_BLOCKS
from tests.compute.kv_transfer.peer import random_cache


def test_fake_blocks_arrive_bit_identical(layout):
    src, dst = KVPool(layout, random_cache(layout, 12, 1)), KVPool.allocate(layout, 8)
    released = []
    with make_transfer("fake", "prefill", layout, src, on_release=lambda *a: released.append(a)) as s, \
            make_transfer("fake", "decode", layout, dst, delay_polls=2) as r:  # fmt: skip
        h = s.offer("r1", SRC_BLOCKS, NUM_TOKENS)
        tid = r.start(h, DST_BLOCKS)
        assert r.poll(tid) == TransferState.TRANSFERRING
        assert wait(r.poll, tid, 5) == TransferState.DONE
        assert torch.equal(dst.gather(DST_BLOCKS), src.gather(SRC_BLOCKS))
        assert s.poll("r1") == TransferState.DONE and s.held() == 0
        assert released == [("r1", SRC_BLOCKS, TransferState.DONE)]
        with pytest.raises(ValueError):
            r.start(h, [0, 1])  # too few destination blocks
        with pytest.raises(ValueError):
            s.offer("r2", [1, 2], 20)  # 20 tokens need 5 blocks


def test_fake_never_confirmed_is_released_after_hold_s(layout):
    pool = KVPool.allocate(layout, 8)
    released = []
    with make_transfer("fake", "prefill", layout, pool, hold_s=0.2, timeout_s=0.1,
                       on_release=lambda *a: released.append(a)) as s:  # fmt: skip
        h = s.offer("r1", [0, 1], 5)
        assert s.held() == 1
        time.sleep(0.25)
        assert s.held() == 0 and s.poll("r1") == TransferState.FAILED
        assert isinstance(s.failure("r1"), TransferFailed) and s.failure("r1").reason == "expired"
        assert released == [("r1", [0, 1], TransferState.FAILED)]
        r = make_transfer("fake", "decode", layout, KVPool.allocate(layout, 8), timeout_s=0.1)
        assert r.poll(r.start(h, [2, 3])) == TransferState.FAILED  # a late receiver fails, touching nothing


def test_fake_200_requests_with_failures_and_aborts_leak_nothing(layout):
    rng = random.Random(5)
    src, dst = KVPool.allocate(layout, 64), KVPool.allocate(layout, 64)
    released = Counter()
    s = make_transfer("fake", "prefill", layout, src, hold_s=0.3, timeout_s=0.2,
                      on_release=lambda rid, blocks, st: released.update([rid]))  # fmt: skip
    r = make_transfer("fake", "decode", layout, dst, fail_rate=0.2, delay_polls=1, timeout_s=0.2, seed=3)
    tids, offered = [], []
    for i in range(200):
        rid, blocks = f"q{i}", rng.sample(range(64), 3)
        h = s.offer(rid, blocks, 12)
        offered.append(rid)
        fate = rng.random()
        if fate < 0.1:
            continue  # the decode side never shows up: hold_s releases it
        if fate < 0.2:
            s.abort(rid)  # the prefill side cancels first
        tid = r.start(h, rng.sample(range(64), 3))
        tids.append(tid)
        if fate > 0.9:
            r.poll(tid)
            r.abort(tid)  # the decode side aborts mid-transfer
        for t in tids[-4:]:  # a few transfers in flight at once
            r.poll(t)
    end = time.monotonic() + 3
    while (s.held() or r.active()) and time.monotonic() < end:
        for t in tids:
            r.poll(t)
        time.sleep(0.01)
    assert s.held() == 0 and r.active() == 0
    assert all(r.poll(t).terminal for t in tids)
    assert released == Counter(offered)  # every offer released exactly once
    states = Counter(r.poll(t).value for t in tids)
    assert states["done"] > 100 and states["failed"] > 30, states


def test_fake_moves_only_blocks_past_the_receivers_own(layout):
    src, dst = KVPool(layout, random_cache(layout, 12, 1)), KVPool.allocate(layout, 8)
    with make_transfer("fake", "prefill", layout, src) as s, make_transfer("fake", "decode", layout, dst) as r:
        tid = r.start(s.offer("r1", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS, first_block=2)
        assert wait(r.poll, tid, 5) == TransferState.DONE and s.held() == 0
        assert r.stats(tid).wire_nbytes == layout.bytes_per_block
        assert torch.equal(dst.gather(DST_BLOCKS[2:]), src.gather(SRC_BLOCKS[2:]))
        assert not dst.gather(DST_BLOCKS[:2]).any()
