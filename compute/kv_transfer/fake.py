"""In-process twin of a transfer backend: a dict registry, no network. For tests and warm-up.

The receiver copies on ``poll`` (after ``delay_polls`` polls in TRANSFERRING),
through the same holds, codecs and states as the real backends; ``fail_rate``
injects transfer failures (reason ``injected``) with a seeded RNG.
"""

from __future__ import annotations

import random
import threading
import uuid

from compute.kv_transfer.base import KVReceiver, KVSender, TransferState
from compute.kv_transfer.compression import get_codec
from compute.kv_transfer.handle import FakeHandle

_REGISTRY: dict[str, FakeSender] = {}
_LOCK = threading.Lock()


class FakeSender(KVSender):
    backend = "fake"

    def __init__(self, pool, config, on_release=None):
        super().__init__(pool, config.hold_s, config.timeout_s, on_release)
        self.codec = get_codec(config.compression)
        self.address = f"fake://{uuid.uuid4().hex}"
        with _LOCK:
            _REGISTRY[self.address] = self

    def offer(self, request_id, block_ids, num_tokens):
        h = self._hold(request_id, block_ids, num_tokens)
        h.wire_nbytes = h.n * 2 * self.layout.num_layers * self.codec.wire_nbytes(self.layout)
        return self._handle(FakeHandle, h, self.codec.name, address=self.address)

    def close(self):
        self._closed.set()
        with _LOCK:
            _REGISTRY.pop(self.address, None)
        self._close_all()


class FakeReceiver(KVReceiver):
    backend = "fake"

    def __init__(self, pool, config, fail_rate: float = 0.0, delay_polls: int = 0, seed: int = 0):
        super().__init__(pool, config.timeout_s)
        self.fail_rate, self.delay_polls = fail_rate, delay_polls
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def start(self, handle, dst_block_ids, first_block=0):
        dst = self._check_handle(handle, dst_block_ids, first_block)
        t = self._new(handle, dst, first_block)
        t.extra.update(handle=handle, polls=self.delay_polls)
        return t.id

    def _advance(self, t):
        with self._lock:
            if t.terminal:
                return
            h = t.extra["handle"]
            if t.overdue():
                self._fail(t, "timeout")
                return
            sender = _REGISTRY.get(h.address)
            if sender is None:
                self._finish(t, TransferState.FAILED, "peer_lost")
                return
            if "hold" not in t.extra:
                hold, reason = sender._ledger.begin(h.request_id)
                if hold is None:
                    self._finish(t, TransferState.FAILED, reason)
                    return
                t.extra["hold"] = hold
                self._ledger.moving(t)
            hold = t.extra["hold"]
            if hold.cut:  # the prefill side aborted mid-stream
                self._fail(t, hold.ending or "aborted")
                return
            if t.extra["polls"] > 0:
                t.extra["polls"] -= 1
                return
            if self._rng.random() < self.fail_rate:
                self._fail(t, "injected")
                return
            codec = get_codec(h.codec)
            if t.dst:  # blocks [first, n): the receiver holds the others
                data = sender.pool.gather(hold.block_ids[t.first : hold.n])
                if codec.name != "none":
                    data = codec.decode(codec.encode(data), self.layout)
                self.pool.scatter(t.dst, data)
            hold.wire_nbytes = t.wire_nbytes
            self._finish(t, TransferState.DONE)
            sender._finish(h.request_id, TransferState.DONE)

    def abort(self, transfer_id):
        with self._lock:
            t = self._ledger.get(transfer_id)
            if t is not None and not t.terminal:
                self._fail(t, "aborted")

    def _fail(self, t, reason):
        """Fail both ends of a begun transfer (the sender's hold ends with it)."""
        self._finish(t, TransferState.FAILED, reason)
        sender = _REGISTRY.get(t.extra["handle"].address)
        if sender is not None and "hold" in t.extra:
            sender._finish(t.request_id, TransferState.FAILED, reason)
