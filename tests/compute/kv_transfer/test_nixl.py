"""nixl-cu12 over UCX between two real processes (no GPU): READ of registered blocks."""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

pytest.importorskip("nixl_cu12")

from compute.kv_transfer import (
    KVPool,
    TransferState,
    TransportDead,
    make_transfer,
    metrics,
    wait,
)
from compute.kv_transfer.handle import AnyHandle, NixlHandle
from tests.compute.kv_transfer.conftest import DST_BLOCKS, NUM_TOKENS, SRC_BLOCKS
from tests.compute.kv_transfer.peer import Peer, random_cache
from tests.services import wait_for

FAILED, DONE = TransferState.FAILED, TransferState.DONE


@pytest.fixture(scope="module")
def receiver(layout):
    r = make_transfer("nixl", "decode", layout, KVPool.allocate(layout, 8), timeout_s=5.0)
    assert type(r).__name__ == "NixlReceiver"
    yield r
    r.close()


def _expected(layout):
    return KVPool(layout, random_cache(layout, 12, 1)).gather(SRC_BLOCKS)


def test_nixl_two_processes_bit_identical(peer, receiver, layout):
    receiver.pool.tensor.zero_()
    before = metrics.BYTES.labels("nixl", "received")._value.get()
    h = peer.call("offer", "nixl", "n1", SRC_BLOCKS, NUM_TOKENS)
    h = msgspec.json.decode(msgspec.json.encode(h), type=AnyHandle)  # as it travels: JSON, checked as it is decoded
    assert isinstance(h, NixlHandle) and h.region.nbytes > 0 and h.blocks == SRC_BLOCKS and h.metadata
    tid = receiver.start(h, DST_BLOCKS)
    assert wait(receiver.poll, tid, 10) == DONE, receiver.failure(tid)
    assert torch.equal(receiver.pool.gather(DST_BLOCKS), _expected(layout))
    assert receiver.pool.tensor[:, :, [2, 3, 4, 6, 7]].eq(0).all()  # nothing else written
    assert peer.call("wait", "nixl", "n1", 5) == ("done", "")  # the "done" notification arrived
    assert peer.call("held", "nixl", 5) == 0
    assert metrics.BYTES.labels("nixl", "received")._value.get() - before == 3 * layout.bytes_per_block


def test_nixl_int8_staged_round_trip(peer, receiver, layout):
    h = peer.call("offer", "nixl-int8", "z1", SRC_BLOCKS, NUM_TOKENS)
    assert h.codec == "int8" and h.nbytes / h.wire_nbytes == pytest.approx(256 / 128)  # unit 4x2x8 fp32: q 64 + scales 32 + channels 32
    tid = receiver.start(h, DST_BLOCKS)
    assert wait(receiver.poll, tid, 10) == DONE, receiver.failure(tid)
    want = _expected(layout)
    from compute.kv_transfer.compression import CODECS

    local = CODECS["int8"].decode(CODECS["int8"].encode(want), layout)  # what the wire must deliver
    assert torch.equal(receiver.pool.gather(DST_BLOCKS), local)
    assert peer.call("wait", "nixl-int8", "z1", 5) == ("done", "")
    assert peer.call("held", "nixl-int8", 5) == 0  # staging slots and blocks released


def _quarantine(event):
    return metrics.QUARANTINE.labels("nixl", event)._value.get()


def test_nixl_abort_in_flight_never_writes_freed_blocks(receiver, layout):
    """An abort while the READ is in flight: FAILED("aborted") at once; the READ lands once the frozen peer
    resumes, and must land nowhere in the cache (the caller has freed the blocks: they may hold another
    request's KV by then); the sender learns of the abort while the receiver makes no call at all.
    In flight for sure: the first READ to a fresh prefill process needs that process to progress UCX's
    wire-up, and it is frozen (SIGSTOP). Control, measured here: a first READ to another fresh prefill
    process, from start() to its sender reporting DONE (wire-up, READ, notification, the pipe)."""
    senders = {"nixl": {"backend": "nixl", "hold_s": 60.0}}  # the sender must learn it, not expire
    with ThreadPoolExecutor(2) as ex:
        victim, control = ex.map(lambda seed: Peer.spawn(layout, senders, seed=seed), (1, 2))
    try:
        t0 = time.monotonic()
        assert wait(receiver.poll, receiver.start(control.call("offer", "nixl", "c1", SRC_BLOCKS, NUM_TOKENS),
                                                  [2, 3, 4]), 10) == DONE  # fmt: skip
        assert control.call("wait", "nixl", "c1", 10) == ("done", "")
        bound = 10 * (time.monotonic() - t0)
        held, freed = _quarantine("held"), _quarantine("freed")
        h, after = (victim.call("offer", "nixl", rid, SRC_BLOCKS, NUM_TOKENS) for rid in ("ab1", "ab2"))
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            tid = receiver.start(h, DST_BLOCKS)
            assert receiver.poll(tid) == TransferState.TRANSFERRING  # posted; cannot complete while frozen
            receiver.abort(tid)
            assert receiver.poll(tid) == FAILED and receiver.failure(tid).reason == "aborted"
            assert receiver.quarantined() == 1 and _quarantine("held") == held + 1
            receiver.pool.tensor[:, :, DST_BLOCKS] = -7.0  # the freed blocks, reused by another request
            cache = receiver.pool.tensor.clone()
            time.sleep(bound / 10)
            assert receiver.quarantined() == 1  # frozen peer: the READ has not stopped, so it stays aside
        finally:
            t0 = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGCONT)
        # the receiver stays idle from here until the sender has answered
        assert victim.call("wait", "nixl", "ab1", 10) == ("failed", "aborted")
        notice_s = time.monotonic() - t0
        assert notice_s <= bound, f"abort notice took {notice_s:.3f} s, control bound {bound:.3f} s"
        wait_for(lambda: receiver.quarantined() == 0, 10, "the READ to stop")
        assert _quarantine("freed") == freed + 1  # seen DONE/ERR: it did land, in its quarantined scratch
        assert torch.equal(receiver.pool.tensor, cache)  # nothing in the cache was written
        assert wait(receiver.poll, receiver.start(after, [2, 3, 4]), 10) == DONE
        assert victim.call("wait", "nixl", "ab2", 10) == ("done", "")
        assert victim.call("held", "nixl", 5) == 0
    finally:
        victim.stop()
        control.stop()


def test_nixl_timed_out_read_never_stopping_is_leaked_not_reused(layout):
    """A READ that times out with its peer frozen past the quarantine (hold_s): its scratch is given up on
    (counted, kept), the cache is still never written once the peer resumes."""
    victim = Peer.spawn(layout, {"nixl": {"backend": "nixl", "hold_s": 60.0}}, seed=1)
    receiver = make_transfer("nixl", "decode", layout, KVPool.allocate(layout, 8), timeout_s=0.3, hold_s=0.6)
    try:
        leaked = _quarantine("leaked")
        h = victim.call("offer", "nixl", "lk1", SRC_BLOCKS, NUM_TOKENS)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            tid = receiver.start(h, DST_BLOCKS)
            assert wait(receiver.poll, tid, 5) == FAILED and receiver.failure(tid).reason == "timeout"
            assert receiver.quarantined() == 1
            wait_for(lambda: receiver.quarantined() == 0, 5 + receiver.quarantine_s, "the scratch to be leaked")
            assert _quarantine("leaked") == leaked + 1
            receiver.pool.tensor[:, :, DST_BLOCKS] = -7.0
            cache = receiver.pool.tensor.clone()
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        assert victim.call("wait", "nixl", "lk1", 10) == ("failed", "aborted")  # told, though late
        after = victim.call("offer", "nixl", "lk2", SRC_BLOCKS, NUM_TOKENS)
        assert wait(receiver.poll, receiver.start(after, [2, 3, 4]), 10) == DONE  # connected, progressed
        cache[:, :, [2, 3, 4]] = receiver.pool.tensor[:, :, [2, 3, 4]]
        assert torch.equal(receiver.pool.tensor, cache)
    finally:
        receiver.close()
        victim.stop()


def test_nixl_abort_after_done_changes_nothing(peer, receiver):
    h = peer.call("offer", "nixl", "ab3", SRC_BLOCKS, NUM_TOKENS)
    tid = receiver.start(h, DST_BLOCKS)
    assert wait(receiver.poll, tid, 10) == DONE
    receiver.abort(tid)
    assert receiver.poll(tid) == DONE and receiver.failure(tid) is None
    assert peer.call("wait", "nixl", "ab3", 5) == ("done", "")
    assert peer.call("held", "nixl", 5) == 0


def test_nixl_expired_handle_is_refused(peer, receiver):
    h = peer.call("offer", "nixl", "old1", SRC_BLOCKS, NUM_TOKENS)
    tid = receiver.start(msgspec.structs.replace(h, expires_at=time.time() + 1.0), DST_BLOCKS)  # less than timeout_s left
    assert receiver.poll(tid) == FAILED and receiver.failure(tid).reason == "expired"


def test_nixl_sender_killed_fails_within_deadline(layout):
    """A READ is one-sided and takes microseconds here, so "mid-transfer" means: the
    peer dies with a READ posted (connected) and with handles still to be read."""
    victim = Peer.spawn(layout, {"nixl": {"backend": "nixl"}}, seed=1)
    receiver = make_transfer("nixl", "decode", layout, KVPool.allocate(layout, 8), timeout_s=1.5)
    try:
        hs = [victim.call("offer", "nixl", f"k{i}", SRC_BLOCKS, NUM_TOKENS) for i in range(3)]
        t0 = time.monotonic()
        assert wait(receiver.poll, receiver.start(hs[0], DST_BLOCKS), 5) == DONE  # connected
        # the control, measured here: a whole READ, wire-up included; the slack past the deadline (one poll,
        # scheduling) is a part of it, so the bound moves with this machine's speed
        bound = receiver.timeout_s + 5 * (time.monotonic() - t0)
        tid = receiver.start(hs[1], DST_BLOCKS)  # posted, not polled yet
        victim.kill()
        t0 = time.monotonic()
        assert wait(receiver.poll, tid, 5).terminal and time.monotonic() - t0 <= bound
        tid = receiver.start(hs[2], DST_BLOCKS)  # the peer is gone
        assert wait(receiver.poll, tid, 5) == FAILED and time.monotonic() - t0 <= bound
        assert receiver.failure(tid).reason in ("peer_lost", "timeout") and receiver.active() == 0
    finally:
        receiver.close()
        victim.stop()


def test_nixl_unusable_falls_back_to_tcp_loudly(layout, monkeypatch, caplog):
    from compute.kv_transfer import nixl

    def dead():
        raise TransportDead("no UCX here")

    monkeypatch.setattr(nixl, "process_agent", dead)
    before = metrics.FALLBACKS.labels("nixl", "tcp")._value.get()
    with caplog.at_level(logging.WARNING, logger="compute.kv_transfer.factory"):
        s = make_transfer("nixl", "prefill", layout, KVPool.allocate(layout, 4))
    try:
        assert s.backend == "tcp" and "falling back to tcp" in caplog.text
        assert metrics.FALLBACKS.labels("nixl", "tcp")._value.get() == before + 1
    finally:
        s.close()
    with pytest.raises(TransportDead):
        make_transfer("nixl", "prefill", layout, KVPool.allocate(layout, 4), fallback=False)
