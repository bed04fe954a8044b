"""NIXL (over UCX) KV transfer: the decode side READs the prefill side's registered blocks.

Lifecycle of one request::

    prefill (NixlSender)                         decode (NixlReceiver)
    cache registered once (one DRAM region)      cache registered once
    offer: hold blocks; handle = agent name,
      agent metadata (base64), region geometry,
      block ids (or staging slots, compressed)
                                                 start: load peer metadata (once per peer),
                                                   descriptors = adjacent (layer, kv, block)
                                                   units merged on both sides, prep_xfer_dlist
                                                   x2, make_prepped_xfer(READ), transfer
                                                 poll: check_xfer_state -> DONE | ERR | deadline
                                                   DONE: (decode staging) send_notif("done")
    progress loop sees "done" -> DONE, release   abort / timeout: send_notif("abort")
      (or "abort" -> FAILED, or hold_s -> FAILED)

One agent per process (``nixl_agent_config(backends=["UCX"], enable_prog_thread=
False)``, creation ~0.5 s), shared by its senders and receivers, every call under
one lock (the agent is built without NIXL's own locking). NIXL's metadata
listener (0.0.0.0:8888) is not used: metadata travels in the handle.

Progress: without NIXL's progress thread, UCX moves only when this process
calls into the agent. A READ is one-sided once connected, but the first READ
from a new peer needs the *target* to progress the wire-up, and a notification
is delivered only when the target progresses. So each sender runs a light loop
(every 2 ms: read notifications, expire holds). The "done" notification is sent
separately after the READ completes (a READ with an attached notification does
not complete until the target progresses).

Compression: a READ runs nothing on the prefill node, so compressed units must
exist before it: ``offer`` encodes the request's blocks into a registered
staging region ``uint8 [L, 2, staging_blocks, wire]`` (same unit geometry as
the cache) and the handle points at those slots; the decode side reads them
into a registered scratch buffer and decodes into its blocks.

Caveat: the prefill side cannot revoke a READ. A receiver only starts when it
can finish before the handle's ``expires_at`` (see ``base``), but a sender-side
``abort``/``release`` during a READ frees blocks the peer may still be reading.
The environment (``UCX_NET_DEVICES``, ``NIXL_LOG_LEVEL``) is the caller's.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import socket
import threading
import uuid

import numpy as np
import torch
import xxhash

from compute.kv_transfer.base import (
    KVReceiver,
    KVSender,
    TransferFailed,
    TransferState,
    TransportDead,
)
from compute.kv_transfer.compression import get_codec
from compute.kv_transfer.layout import BlockRegion, paired_runs

log = logging.getLogger(__name__)

_PROGRESS_S = 0.002  # sender progress loop period

_AGENT: _Agent | None = None
_AGENT_LOCK = threading.Lock()


def process_agent() -> _Agent:
    """This process's NIXL agent, created on first use. ``ImportError`` without nixl-cu12,
    ``TransportDead`` when the agent or its UCX backend cannot be created."""
    global _AGENT
    with _AGENT_LOCK:
        if _AGENT is None:
            _AGENT = _Agent()
        return _AGENT


class _Agent:
    def __init__(self):
        from nixl_cu12 import (  # ImportError: the factory falls back
            nixl_agent,
            nixl_agent_config,
        )

        self.name = f"pdserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        except Exception as e:
            raise TransportDead(f"nixl: cannot create agent: {e}") from e
        if "UCX" not in self.agent.backends:
            raise TransportDead("nixl: UCX backend unavailable")
        # Never destroyed: the agent lives as long as the process, and destroying it
        # after a peer died with a notification still queued to it and a READ posted
        # to it makes UCX abort the process (arbiter.c "ucs_arbiter_group_is_empty",
        # nixl-cu12 1.5.1). The OS reclaims it at exit.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.agent.agent))
        self.lock = threading.RLock()
        self._md: bytes | None = None
        self._peers: dict[int, str] = {}  # xxh3 of loaded metadata -> agent name
        self._inbox: dict[str, list[tuple[str, str]]] = {}  # sender id -> [(op, request_id)]

    def register(self, t: torch.Tensor):
        """Register ``t``'s whole storage as one DRAM region (``t`` may be a permuted view)."""
        st = t.untyped_storage()
        with self.lock:
            self._md = None
            return self.agent.register_memory([(st.data_ptr(), st.nbytes(), 0, "")], "DRAM")

    def deregister(self, descs) -> None:
        with self.lock:
            self._md = None
            self.agent.deregister_memory(descs)

    def metadata(self) -> bytes:
        with self.lock:
            if self._md is None:
                self._md = self.agent.get_agent_metadata()
            return self._md

    def peer(self, md: bytes) -> str:
        """Load a peer's metadata (again only if it changed); returns its agent name."""
        key = xxhash.xxh3_64_intdigest(md)
        with self.lock:
            if key not in self._peers:
                name = self.agent.add_remote_agent(md)
                self._peers[key] = name.decode() if isinstance(name, bytes) else name
            return self._peers[key]

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray):
        """Post a READ of ``remote`` into ``local`` (Nx3 uint64 descriptors) -> (xfer, dlists, status)."""
        idx = np.arange(len(local), dtype=np.int32)
        made = []
        with self.lock:
            try:
                made.append(self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"))
                made.append(self.agent.prep_xfer_dlist(peer, remote, "DRAM"))
                x = self.agent.make_prepped_xfer("READ", made[0], idx, made[1], idx)
                made.insert(0, x)
                return x, tuple(made[1:]), self.agent.transfer(x)
            except Exception:
                # a failed post must be released now: a leaked request to a dead peer
                # makes UCX abort the whole process at exit
                self.release(*made)
                raise

    def state(self, x) -> str:
        """"DONE" | "PROC" | "ERR" (a disconnected peer raises in NIXL: "ERR" here)."""
        with self.lock:
            try:
                return self.agent.check_xfer_state(x)
            except Exception as e:  # noqa: BLE001 - NIXL raises on a disconnected peer
                log.debug("nixl: transfer state: %s", e)
                return "ERR"

    def release(self, *handles) -> None:
        with self.lock:
            for h in handles:
                try:
                    h.release()
                except Exception as e:  # noqa: BLE001 - cannot cancel: NIXL keeps it
                    log.warning("nixl: release of %r failed: %s", h, e)

    def notify(self, peer: str, msg: str) -> None:
        with self.lock:
            try:
                self.agent.send_notif(peer, msg.encode())
            except Exception as e:  # noqa: BLE001 - a dead peer released (or died) on its own
                log.debug("nixl: notif to %s failed: %s", peer, e)

    def subscribe(self, sender_id: str) -> None:
        with self.lock:
            self._inbox.setdefault(sender_id, [])

    def unsubscribe(self, sender_id: str) -> None:
        with self.lock:
            self._inbox.pop(sender_id, None)

    def take(self, sender_id: str) -> list[tuple[str, str]]:
        """Progress UCX, sort new notifications ``op:sender:request`` to their senders, return ours."""
        with self.lock:
            for msgs in self.agent.get_new_notifs().values():
                for m in msgs:
                    parts = m.decode(errors="replace").split(":", 2)
                    if len(parts) == 3 and parts[1] in self._inbox:
                        self._inbox[parts[1]].append((parts[0], parts[2]))
            mine, self._inbox[sender_id] = self._inbox.get(sender_id, []), []
            return mine


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
        return {**self._base_handle(h, self.codec.name, h.wire_nbytes), "agent": self.agent.name,
                "metadata": base64.b64encode(self.agent.metadata()).decode(), "sender": self.id,
                "region": region.to_dict(), "blocks": blocks}  # fmt: skip

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
    backend = "nixl"

    def __init__(self, pool, config):
        super().__init__(pool, config.timeout_s)
        self.agent = process_agent()
        self._reg = self.agent.register(pool.tensor)
        self._lock = threading.Lock()

    def start(self, handle, dst_block_ids):
        dst = self._check_handle(handle, dst_block_ids)
        t = self._new(handle, dst)
        if t.terminal:
            return t.id
        codec = get_codec(handle["codec"])
        t.extra.update(sender=handle["sender"], codec=codec)
        try:
            t.extra["peer"] = self.agent.peer(base64.b64decode(handle["metadata"]))
            remote = BlockRegion.from_dict(handle["region"])
            if codec.name == "none":
                local, local_blocks = self.pool.region, dst
            else:
                scratch = torch.empty((self.layout.num_layers, 2, len(dst), codec.wire_nbytes(self.layout)),
                                      dtype=torch.uint8)  # fmt: skip
                t.extra.update(scratch=scratch, scratch_reg=self.agent.register(scratch))
                local, local_blocks = BlockRegion.of(scratch), list(range(len(dst)))
            so, do, ln = paired_runs(remote.offsets(handle["blocks"]), local.offsets(local_blocks), local.unit_nbytes)
            zero = np.zeros_like(ln)
            rdesc = np.stack((remote.base + so, ln, zero), 1).astype(np.uint64)
            ldesc = np.stack((local.base + do, ln, zero), 1).astype(np.uint64)
            t.extra["xfer"], t.extra["dlists"], status = self.agent.read(t.extra["peer"], ldesc, rdesc)
        except Exception as e:  # noqa: BLE001 - bad metadata / dead peer: this request only
            log.warning("nixl: cannot start READ of %s: %s", t.request_id, e)
            status = "ERR"
        with self._lock:
            if status == "ERR":
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

    def close(self):
        super().close()
        if self._reg is not None:
            self.agent.deregister(self._reg)
            self._reg = None

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
        """Under ``self._lock``: free NIXL resources, decode, finish, tell the sender."""
        if "xfer" in t.extra:
            self.agent.release(t.extra.pop("xfer"), *t.extra.pop("dlists"))
        if state == TransferState.DONE and "scratch" in t.extra:
            self.pool.scatter(t.dst, t.extra["codec"].decode(t.extra["scratch"], self.layout))
        if "scratch_reg" in t.extra:
            self.agent.deregister(t.extra.pop("scratch_reg"))
            t.extra.pop("scratch")
        self._finish(t, state, reason)
        if "peer" in t.extra and reason != "peer_lost":  # a lost peer released (or died) already
            op = "done" if state == TransferState.DONE else "abort"
            self.agent.notify(t.extra["peer"], f"{op}:{t.extra['sender']}:{t.request_id}")
