"""NIXL (over UCX) KV transfer: the decode side READs the prefill side's registered blocks.

Lifecycle of one request::

    prefill (NixlSender)                         decode (NixlReceiver)
    cache registered once (one DRAM region)
    offer: hold blocks; handle = agent name,
      agent metadata, region geometry,
      block ids (or staging slots, compressed)
                                                 start: load peer metadata (once per peer),
                                                   register a scratch [L, 2, n, wire] for it,
                                                   descriptors = adjacent (layer, kv, block)
                                                   units merged on both sides, prep_xfer_dlist
                                                   x2, make_prepped_xfer(READ), transfer
                                                 poll: check_xfer_state -> DONE | ERR | deadline
                                                   DONE: scratch -> destination blocks (decoded),
                                                   send_notif("done")
    progress loop sees "done" -> DONE, release   abort / timeout: send_notif("abort"); a READ
      (or "abort" -> FAILED, or hold_s -> FAILED)  still PROC goes to quarantine (below)

Quarantine: NIXL cannot stop a posted READ. ``release_xfer_handle`` on a busy
handle makes the UCX backend call ``ucp_request_cancel`` and report success
whatever UCX did (an RMA get is not cancelled: it lands when the peer answers,
e.g. a frozen prefill process resuming). So the READ never targets the cache:
it targets the transfer's own scratch, and a transfer that ends while its READ
is PROC keeps scratch and handle aside until ``check_xfer_state`` says DONE or
ERR (then both are freed), or for ``hold_s`` at most: then the handle is
released and the scratch stays registered and referenced for the process's
life (logged, ``pdserve_kv_transfer_quarantine{event="leaked"}``). The
destination blocks go back to the engine as soon as the transfer is FAILED,
and nothing writes them after that. Scratch buffers (power-of-two block counts)
are registered once and reused, one spare per size. The cost is one copy of the
KV on DONE (the int8 path decodes from a scratch anyway): an 8 MB READ here took
~2.5 ms instead of ~2.0 ms.

One agent per process (``nixl_agent``), shared by its senders and receivers.

Progress: without NIXL's progress thread, UCX moves only when this process
calls into the agent. A READ is one-sided once connected, but the first READ
from a new peer needs the *target* to progress the wire-up, and a notification
is delivered only when the target progresses. So each sender runs a light loop
(every 2 ms: read notifications, expire holds). The "done" notification is sent
separately after the READ completes (a READ with an attached notification does
not complete until the target progresses). Likewise a notification leaves (and a
first connection is wired up) only while the agent that posted it progresses, so
each receiver runs a loop too while something is on the way: every 2 ms until the
sender's hold deadline after a notification, and while a READ is quarantined; idle
otherwise. An abort reaches the sender at once even if the decode node goes quiet.

Compression: a READ runs nothing on the prefill node, so compressed units must
exist before it: ``offer`` encodes the request's blocks into a registered
staging region ``uint8 [L, 2, staging_blocks, wire]`` (same unit geometry as
the cache) and the handle points at those slots; the decode side reads them
into a registered scratch buffer and decodes into its blocks.

Caveat: the prefill side cannot revoke a READ. A receiver only starts when it
can finish before the handle's ``expires_at`` (see ``base``), but a sender-side
``abort``/``release`` during a READ frees blocks the peer may still be reading.
That READ then delivers garbage into a scratch, never into another request's blocks.
The environment (``UCX_NET_DEVICES``, ``NIXL_LOG_LEVEL``) is the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from compute.kv_transfer.base import (
    KVReceiver,
    KVSender,
    TransferFailed,
    TransferState,
)
from compute.kv_transfer.compression import get_codec
from compute.kv_transfer.handle import NixlHandle
from compute.kv_transfer.layout import BlockRegion, paired_runs
from compute.kv_transfer.nixl_agent import process_agent

log = logging.getLogger(__name__)

_PROGRESS_S = 0.002  # progress loops' period (senders; receivers while busy)

class NixlSender(KVSender):
    backend = "nixl"

    def __init__(self, pool, config, on_release=None):
        super().__init__(pool, config.hold_s, config.timeout_s, on_release)
        self.agent = process_agent()
        self.codec = get_codec(config.compression)
        self.id = uuid.uuid4().hex[:12]
        self._regs = [self.agent.register(pool.tensor)]
        self._staging: torch.Tensor | None = None
        self._slots_lock = threading.Lock()
        if self.codec.name != "none":
            shape = (self.layout.num_layers, 2, config.staging_blocks, self.codec.wire_nbytes(self.layout))
            self._staging = torch.zeros(shape, dtype=torch.uint8)
            self._regs.append(self.agent.register(self._staging))
            self._staging_region = BlockRegion.of(self._staging)
            self._free = set(range(config.staging_blocks))
        self.agent.subscribe(self.id)
        self._thread = threading.Thread(target=self._loop, name="kv-nixl-progress", daemon=True)
        self._thread.start()

    def offer(self, request_id, block_ids, num_tokens):
        n = self.layout.num_blocks_for(num_tokens)
        slots = self._take_slots(request_id, n) if self._staging is not None else None
        try:
            h = self._hold(request_id, block_ids, num_tokens)
        except Exception:
            self._give_slots(slots)
            raise
        region, blocks = self.pool.region, h.block_ids[: h.n]
        if slots is not None:
            h.extra["slots"] = slots
            self._staging[:, :, torch.tensor(slots)] = self.codec.encode(self.pool.gather(blocks))
            region, blocks = self._staging_region, slots
        h.wire_nbytes = h.n * 2 * self.layout.num_layers * self.codec.wire_nbytes(self.layout)
        return self._handle(NixlHandle, h, self.codec.name, agent=self.agent.name, metadata=self.agent.metadata(),
                            sender=self.id, region=region, blocks=list(blocks))  # fmt: skip

    def close(self):
        self._closed.set()
        self._thread.join(2)
        self._close_all()
        self.agent.unsubscribe(self.id)
        for r in self._regs:
            self.agent.deregister(r)
        self._regs = []

    def _take_slots(self, request_id, n) -> list[int]:
        with self._slots_lock:
            if len(self._free) < n:
                raise TransferFailed(request_id, "staging_full", f"{n} slots wanted, {len(self._free)} free")
            slots = sorted(self._free)[:n]
            self._free.difference_update(slots)
            return slots

    def _give_slots(self, slots) -> None:
        if slots:
            with self._slots_lock:
                self._free.update(slots)

    def _on_released(self, hold):
        self._give_slots(hold.extra.get("slots"))

    def _progress(self):
        for op, rid in self.agent.take(self.id):
            h = self._ledger.get(rid)
            if h is None or h.terminal:
                continue
            if op == "done":
                self._finish(rid, TransferState.DONE)
            elif op == "abort":
                self._finish(rid, TransferState.FAILED, "aborted")

    def _loop(self):
        while not self._closed.wait(_PROGRESS_S):
            try:
                self._progress()
                self._expire()
            except Exception:  # keep progressing; a bad notification is not fatal
                log.exception("nixl progress loop")


class NixlReceiver(KVReceiver):
    """Reads into a registered scratch buffer per transfer, never into the cache itself: on DONE
    the scratch is copied (decoded) into the destination blocks. A READ that may still be moving
    when its transfer ends (abort, timeout) keeps its scratch in quarantine; the destination
    blocks go back to the engine at once and no transport ever writes them."""

    backend = "nixl"

    def __init__(self, pool, config):
        super().__init__(pool, config.timeout_s)
        self.agent = process_agent()
        self.quarantine_s = config.hold_s  # an aborted READ not stopped by then is given up on (leaked)
        self._lock = threading.Lock()
        self._quarantine: list[_Stuck] = []
        self._spare: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}  # (blocks, wire) -> scratch
        self._pump_until = 0.0  # monotonic: progress UCX until then (notifications on their way)
        self._closed, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-nixl-receiver", daemon=True)
        self._thread.start()

    def start(self, handle, dst_block_ids, first_block=0):
        dst = self._check_handle(handle, dst_block_ids, first_block)
        t = self._new(handle, dst, first_block)
        if t.terminal:
            return t.id
        if not dst:  # the receiver holds every block: nothing to READ, the sender is told done
            t.extra.update(sender=handle.sender, expires_at=handle.expires_at)
            try:
                t.extra["peer"] = self.agent.peer(handle.metadata)
            except Exception as e:  # noqa: BLE001 - bad metadata / dead peer: its hold expires
                log.warning("nixl: cannot reach the sender of %s: %s", t.request_id, e)
            with self._lock:
                self._ledger.moving(t)
                self._finish(t, TransferState.DONE)
                self._notify(t, TransferState.DONE, "")
            return t.id
        codec = get_codec(handle.codec)
        scratch, reg = self._take_scratch(len(dst), codec.wire_nbytes(self.layout))
        t.extra.update(sender=handle.sender, codec=codec, expires_at=handle.expires_at, scratch=scratch,
                       scratch_reg=reg, posting=True)  # fmt: skip
        try:
            t.extra["peer"] = self.agent.peer(handle.metadata)
            remote, local = handle.region, BlockRegion.of(scratch)
            remote_blocks = handle.blocks[first_block : handle.num_blocks]  # those the receiver lacks
            so, do, ln = paired_runs(remote.offsets(remote_blocks), local.offsets(list(range(len(dst)))),
                                     local.unit_nbytes)  # fmt: skip
            zero = np.zeros_like(ln)
            rdesc = np.stack((remote.base + so, ln, zero), 1).astype(np.uint64)
            ldesc = np.stack((local.base + do, ln, zero), 1).astype(np.uint64)
            t.extra["xfer"], t.extra["dlists"], status = self.agent.read(t.extra["peer"], ldesc, rdesc)
        except Exception as e:  # noqa: BLE001 - bad metadata / dead peer: this request only
            log.warning("nixl: cannot start READ of %s: %s", t.request_id, e)
            status = "ERR"
        with self._lock:
            del t.extra["posting"]
            if t.terminal:  # aborted while posting: its _end left the READ to be settled here
                self._settle(t, TransferState.FAILED)
            elif status == "ERR":
                self._end(t, TransferState.FAILED, "peer_lost")
            else:
                self._ledger.moving(t)
                if status == "DONE":
                    self._end(t, TransferState.DONE)
        return t.id

    def abort(self, transfer_id):
        with self._lock:
            t = self._ledger.get(transfer_id)
            if t is not None and not t.terminal:
                self._end(t, TransferState.FAILED, "aborted")

    def quarantined(self) -> int:
        """Ended transfers whose READ may still be moving (their scratch is held, not reused)."""
        with self._lock:
            return len(self._quarantine)

    def close(self):
        super().close()
        self._closed.set()
        self._wake.set()
        self._thread.join(2)
        with self._lock:
            self._sweep(give_up=True)
            for _, reg in self._spare.values():
                self.agent.deregister(reg)
            self._spare.clear()

    def _advance(self, t):
        with self._lock:
            if t.terminal:
                return
            status = self.agent.state(t.extra["xfer"])
            if status == "DONE":
                self._end(t, TransferState.DONE)
            elif status == "ERR":
                self._end(t, TransferState.FAILED, "peer_lost")
            elif t.overdue():
                self._end(t, TransferState.FAILED, "timeout")

    def _end(self, t, state: TransferState, reason: str = "") -> None:
        """Under ``self._lock``: settle the READ, finish, tell the sender."""
        self._settle(t, state)
        self._finish(t, state, reason)
        self._notify(t, state, reason)

    def _notify(self, t, state: TransferState, reason: str) -> None:
        """Under ``self._lock``: tell the sender the transfer ended (it releases its hold)."""
        if "peer" in t.extra and reason != "peer_lost":  # a lost peer released (or died) already
            op = "done" if state == TransferState.DONE else "abort"
            self.agent.notify(t.extra["peer"], f"{op}:{t.extra['sender']}:{t.request_id}")
            # delivered only as UCX progresses here: keep progressing while the sender still holds
            left = max(t.extra["expires_at"] - time.time(), 0.0)
            self._pump_until = max(self._pump_until, time.monotonic() + min(left, self.quarantine_s))
            self._wake.set()

    def _settle(self, t, state: TransferState) -> None:
        """Under ``self._lock``: decode into the destination (DONE), then free the READ's handle
        and scratch, or quarantine them if the READ may still write."""
        from compute.kv_transfer import metrics

        if t.extra.get("posting"):  # start() settles it once the READ is posted (or not)
            return
        if state == TransferState.DONE:
            self.pool.scatter(t.dst, t.extra["codec"].decode(t.extra["scratch"], self.layout))
        stuck = _Stuck(t.request_id, t.extra.pop("xfer", None), t.extra.pop("dlists", ()),
                       t.extra.pop("scratch", None), t.extra.pop("scratch_reg", None), 0.0)  # fmt: skip
        # DONE / ERR: the READ has stopped. Anything else (PROC, or a state read on an aborted
        # handle): it may still write, and releasing the handle does not stop it (NIXL's UCX
        # backend cancels and reports success whatever UCX did), so it is kept to be watched.
        if stuck.xfer is not None and state != TransferState.DONE and self.agent.state(stuck.xfer) == "PROC":
            stuck.deadline = time.monotonic() + self.quarantine_s
            self._quarantine.append(stuck)
            metrics.QUARANTINE.labels(self.backend, "held").inc()
            self._wake.set()
        else:
            self._free(stuck)

    def _take_scratch(self, n: int, wire: int) -> tuple[torch.Tensor, object]:
        """A registered ``uint8 [L, 2, n, wire]`` view of a buffer of a power-of-two block count
        (one spare kept per size: no registration or page faults per transfer)."""
        cap = 1 << (n - 1).bit_length()
        with self._lock:
            buf, reg = self._spare.pop((cap, wire), (None, None))
        if buf is None:
            buf = torch.zeros(self.layout.num_layers * 2 * cap * wire, dtype=torch.uint8)
            reg = self.agent.register(buf)
        return buf[: self.layout.num_layers * 2 * n * wire].view(self.layout.num_layers, 2, n, wire), reg

    def _free(self, s: _Stuck) -> None:
        """Under ``self._lock``: release a stopped READ's handle; its scratch becomes the spare."""
        if s.xfer is not None:
            self.agent.release(s.xfer, *s.dlists)
        if s.reg is None:
            return
        buf = torch.as_strided(s.scratch, (s.scratch.untyped_storage().nbytes(),), (1,), 0)
        key = (buf.numel() // (self.layout.num_layers * 2 * s.scratch.shape[3]), s.scratch.shape[3])
        if self._closed.is_set() or key in self._spare:
            self.agent.deregister(s.reg)
        else:
            self._spare[key] = (buf, s.reg)

    def _sweep(self, give_up: bool = False) -> None:
        """Under ``self._lock``: free quarantined READs that stopped; past their deadline (or
        ``give_up``) release the handle but keep the scratch registered and alive for good."""
        from compute.kv_transfer import metrics

        now, keep = time.monotonic(), []
        for s in self._quarantine:
            if self.agent.state(s.xfer) != "PROC":
                self._free(s)
                metrics.QUARANTINE.labels(self.backend, "freed").inc()
            elif give_up or now > s.deadline:
                log.warning("nixl: READ of %s still moving past its quarantine (%.1f s, or close); its %d B "
                            "scratch stays registered and is never reused", s.request_id, self.quarantine_s,
                            s.scratch.nbytes)  # fmt: skip
                self.agent.release(s.xfer, *s.dlists)
                _LEAKED.append((s.scratch, s.reg))
                metrics.QUARANTINE.labels(self.backend, "leaked").inc()
            else:
                keep.append(s)
        self._quarantine = keep

    def _loop(self):
        """Progress UCX while something waits on it (notifications, quarantined READs), so an
        abort reaches the sender even when this node makes no further NIXL calls."""
        while not self._closed.is_set():
            busy = bool(self._quarantine) or time.monotonic() < self._pump_until
            if not busy:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self.agent.pump()
                with self._lock:
                    self._sweep()
            except Exception:  # keep progressing
                log.exception("nixl receiver progress loop")
            self._closed.wait(_PROGRESS_S)


@dataclass(slots=True)
class _Stuck:
    """A READ that ended on our side and may still write ``scratch``."""

    request_id: str
    xfer: object
    dlists: tuple
    scratch: torch.Tensor
    reg: object
    deadline: float  # monotonic


_LEAKED: list = []  # (scratch, registration) of READs never seen to stop: kept for the process's life
