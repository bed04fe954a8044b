"""tcp: two real processes, plus in-process failure semantics and the leak loop."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import msgspec
import pytest
import torch

from compute.kv_transfer import KVPool, TransferState, make_transfer, metrics, wait
from tests.compute.kv_transfer.conftest import DST_BLOCKS, NUM_TOKENS, SRC_BLOCKS
from tests.compute.kv_transfer.peer import Peer, random_cache

FAILED, DONE = TransferState.FAILED, TransferState.DONE


def _until(poll, key, state, timeout=5.0) -> TransferState:
    """Poll until ``state`` (or a terminal state, or the timeout)."""
    end = time.monotonic() + timeout
    while (s := poll(key)) != state and not s.terminal and time.monotonic() < end:
        time.sleep(0.002)
    return s


def test_tcp_two_processes_bit_identical(peer, layout):
    dst = KVPool.allocate(layout, 8)
    with make_transfer("tcp", "decode", layout, dst) as r:
        before = metrics.BYTES.labels("tcp", "received")._value.get()
        h = peer.call("offer", "tcp", "p1", SRC_BLOCKS, NUM_TOKENS)
        tid = r.start(h, DST_BLOCKS)
        assert wait(r.poll, tid, 10) == DONE
        assert torch.equal(dst.gather(DST_BLOCKS), KVPool(layout, random_cache(layout, 12, 1)).gather(SRC_BLOCKS))
        assert peer.call("wait", "tcp", "p1", 5) == ("done", "")
        assert peer.call("held", "tcp", 5) == 0
        assert metrics.BYTES.labels("tcp", "received")._value.get() - before == 3 * layout.bytes_per_block
        bad = msgspec.structs.replace(h, request_id="p1", secret="0" * 32)  # a replay / a stranger
        tid = r.start(bad, DST_BLOCKS)
        assert wait(r.poll, tid, 5) == FAILED and r.failure(tid).reason in ("unknown", "done")


def test_tcp_receiver_abort_and_sender_kill_mid_transfer(layout):
    slow = Peer.spawn(layout, {"tcp": {"backend": "tcp", "timeout_s": 20.0, "hold_s": 30.0}}, slow_s=0.1)
    try:
        r = make_transfer("tcp", "decode", layout, KVPool.allocate(layout, 8), timeout_s=5.0)
        # 0. the control, in this run: the whole slow stream. The window to act in and the bounds on
        # reacting are fractions of it, so a faster or slower machine moves them together
        t0 = time.monotonic()
        assert wait(r.poll, r.start(slow.call("offer", "tcp", "c1", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS), 15) == DONE
        stream_s = time.monotonic() - t0
        # 1. the decode side aborts while bytes flow: FAILED now (not when the stream would end), the sender releases
        tid = r.start(slow.call("offer", "tcp", "a1", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS)
        assert _until(r.poll, tid, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
        time.sleep(stream_s / 8)
        assert r.poll(tid) == TransferState.TRANSFERRING  # still mid-stream
        t0 = time.monotonic()
        r.abort(tid)
        assert r.poll(tid) == FAILED and r.failure(tid).reason == "aborted" and time.monotonic() - t0 < stream_s / 4
        assert slow.call("wait", "tcp", "a1", 5)[0] == "failed"
        assert slow.call("held", "tcp", 5) == 0
        # 2. the prefill process dies mid-stream: FAILED as the connection drops, not at the deadline
        tid = r.start(slow.call("offer", "tcp", "k1", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS)
        assert _until(r.poll, tid, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
        time.sleep(stream_s / 8)
        assert r.poll(tid) == TransferState.TRANSFERRING  # still mid-stream
        slow.kill()
        t0 = time.monotonic()
        assert wait(r.poll, tid, 5) == FAILED and time.monotonic() - t0 < stream_s / 4
        assert r.failure(tid).reason == "peer_lost" and r.active() == 0
        tid = r.start(msgspec.structs.replace(r._ledger.get(tid).extra["handle"], request_id="k2"), DST_BLOCKS)
        assert wait(r.poll, tid, 5) == FAILED  # connection refused: fails, does not hang
        r.close()
    finally:
        slow.stop()


def test_tcp_never_confirmed_releases_after_hold_s(layout):
    released = []
    with make_transfer("tcp", "prefill", layout, KVPool.allocate(layout, 8), hold_s=0.3, timeout_s=0.1,
                       on_release=lambda *a: released.append(a)) as s:  # fmt: skip
        s.offer("h1", [1, 2], 8)
        s.offer("h2", [3], 4)
        end = time.monotonic() + 2
        while len(released) < 2 and time.monotonic() < end:
            time.sleep(0.02)  # the accept loop expires holds on its own: nobody polls
        assert sorted(released) == [("h1", [1, 2], FAILED), ("h2", [3], FAILED)]
        assert s.held() == 0 and s.failure("h1").reason == "expired"


def test_tcp_200_transfers_with_injected_failures_leak_nothing(layout):
    rng = random.Random(11)
    # destination blocks are disjoint per transfer, as the block manager gives them: the receiver checksums
    # its blocks after writing, so two in-flight transfers sharing one would fail each other's checksum
    src, dst = KVPool(layout, random_cache(layout, 64, 2)), KVPool.allocate(layout, 3 * 200)
    released, lock = Counter(), threading.Lock()

    def on_release(rid, blocks, state):
        with lock:
            released[rid] += 1

    s = make_transfer("tcp", "prefill", layout, src, hold_s=0.5, timeout_s=0.4, on_release=on_release)
    r = make_transfer("tcp", "decode", layout, dst, timeout_s=0.4)
    tids, offered, fates, fate_of = [], [], Counter(), {}
    for i in range(200):
        rid = f"t{i}"
        h = s.offer(rid, rng.sample(range(64), 3), 12)
        offered.append(rid)
        fate = rng.choice(["ok"] * 6 + ["no_receiver", "sender_abort", "receiver_abort", "bad_secret"])
        fates[fate] += 1
        if fate == "no_receiver":
            continue
        if fate == "sender_abort":
            s.abort(rid)
        if fate == "bad_secret":
            h = msgspec.structs.replace(h, secret="f" * 32)
        tid = r.start(h, [3 * i, 3 * i + 1, 3 * i + 2])
        tids.append(tid)
        fate_of[tid] = fate
        if fate == "receiver_abort":
            r.abort(tid)
        if len(tids) % 8 == 0:  # keep a handful in flight
            for t in tids[-8:]:
                wait(r.poll, t, 2)
    end = time.monotonic() + 5
    while (s.held() or r.active()) and time.monotonic() < end:
        time.sleep(0.02)
    assert s.held() == 0 and r.active() == 0
    assert all(r.poll(t).terminal for t in tids)
    assert released == Counter(offered), "every offer released exactly once"
    done = Counter(fate_of[t] for t in tids if r.poll(t) == DONE)
    # start() does not block: a transfer may finish before the receiver's abort lands, and abort leaves
    # a terminal transfer as it is (the contract). Every other failure injected must never be DONE.
    assert done["ok"] >= fates["ok"] - 2, (done, fates)
    assert set(done) <= {"ok", "receiver_abort"}, (done, fates)
    s.close()
    r.close()


def test_tcp_checksum_mismatch_fails_the_request(layout, monkeypatch):
    from compute.kv_transfer import tcp

    src = KVPool(layout, random_cache(layout, 8, 3))
    with make_transfer("tcp", "prefill", layout, src) as s, \
            make_transfer("tcp", "decode", layout, KVPool.allocate(layout, 8)) as r:  # fmt: skip
        real, calls = tcp._checksum, []
        # sender and receiver digests now differ (xor 1 vs xor 2): a corrupted stream
        monkeypatch.setattr(tcp, "_checksum", lambda views: real(views) ^ len(calls.append(1) or calls))
        tid = r.start(s.offer("x1", [0, 1], 8), [2, 3])
        assert wait(r.poll, tid, 5) == FAILED and r.failure(tid).reason == "checksum"
        assert wait(s.poll, "x1", 5) == FAILED and s.failure("x1").reason == "checksum" and s.held() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_tcp_in_process_bf16_cache(layout, dtype):
    from compute.kv_transfer import KVLayout

    lay = KVLayout(layout.num_layers, layout.block_size, layout.n_kv_heads, layout.head_dim, dtype)
    src, dst = KVPool(lay, random_cache(lay, 12, 4)), KVPool.allocate(lay, 8)
    with make_transfer("tcp", "prefill", lay, src) as s, make_transfer("tcp", "decode", lay, dst) as r:
        tid = r.start(s.offer("b1", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS)
        assert wait(r.poll, tid, 5) == DONE
        assert torch.equal(dst.gather(DST_BLOCKS), src.gather(SRC_BLOCKS))


def test_tcp_moves_only_blocks_past_the_receivers_own(peer, layout):
    """first_block k: the decode side holds blocks [0, k) (its prefix cache); only [k, n) cross the wire."""
    src = KVPool(layout, random_cache(layout, 12, 1))
    for k in (1, 2, 3):  # 3 == all: nothing moves, the sender is still told (and releases)
        dst = KVPool.allocate(layout, 8)
        with make_transfer("tcp", "decode", layout, dst) as r:
            before = metrics.BYTES.labels("tcp", "received")._value.get()
            tid = r.start(peer.call("offer", "tcp", f"f{k}", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS, first_block=k)
            assert wait(r.poll, tid, 10) == DONE
            assert peer.call("wait", "tcp", f"f{k}", 5) == ("done", "")
            moved = (3 - k) * layout.bytes_per_block
            assert r.stats(tid).wire_nbytes == moved == r.stats(tid).nbytes
            assert metrics.BYTES.labels("tcp", "received")._value.get() - before == moved
            assert torch.equal(dst.gather(DST_BLOCKS[k:]), src.gather(SRC_BLOCKS[k:]))
            assert not dst.gather(DST_BLOCKS[:k]).any()  # the held blocks were not written
    assert peer.call("held", "tcp", 5) == 0
    with make_transfer("tcp", "decode", layout, KVPool.allocate(layout, 8)) as r:
        with pytest.raises(ValueError):
            r.start(peer.call("offer", "tcp", "f4", SRC_BLOCKS, NUM_TOKENS), DST_BLOCKS, first_block=4)


def test_tcp_a_flood_of_idle_connections_gets_no_thread_each(layout):
    """Connections that never send a frame (a slow-loris on the KV listener): at most MAX_STREAMS are served at
    once, the rest closed at accept; their threads end once they are gone."""
    import socket

    from compute.kv_transfer.tcp import MAX_STREAMS

    with make_transfer("tcp", "prefill", layout, KVPool.allocate(layout, 8), timeout_s=2.0) as s:
        before = threading.active_count()
        conns = [socket.create_connection(tuple(s.address), timeout=2) for _ in range(MAX_STREAMS + 40)]
        try:
            end = time.monotonic() + 3
            while time.monotonic() < end and len(s._streams) < MAX_STREAMS:
                time.sleep(0.02)
            time.sleep(0.3)  # the accept loop has taken the rest meanwhile
            assert len(s._streams) == MAX_STREAMS and threading.active_count() - before <= MAX_STREAMS
            closed = 0
            for c in conns[MAX_STREAMS:]:
                c.settimeout(1)
                try:
                    closed += c.recv(1) == b""
                except OSError:
                    closed += 1
            assert closed == 40
        finally:
            for c in conns:
                c.close()
        end = time.monotonic() + 5
        while s._streams and time.monotonic() < end:
            time.sleep(0.05)
        assert not s._streams
