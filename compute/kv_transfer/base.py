"""The KV transfer contract: a sender on the prefill node, a receiver on the decode node.

Lifecycle of one request's KV (the caller polls; SGLang style)::

    prefill engine                          decode engine
    --------------                          -------------
    prefill into blocks [3, 7, 9]
    handle = sender.offer(rid, blocks, n)   (handle travels over the node API)
      sender holds blocks                   allocate blocks [0, 1, 5]
                                            tid = receiver.start(handle, [0, 1, 5])
                                            receiver.poll(tid): BOOTSTRAPPING -> TRANSFERRING -> DONE
      receiver confirms -> DONE, released   decode continues from the received KV
    or: hold_s passes / receiver aborts -> FAILED, released

"Released" means the sender stops holding the blocks and calls
``on_release(request_id, block_ids, state)`` so the engine frees them; every
offer ends released exactly once (confirmation, abort, deadline or close), so a
sender never leaks blocks. ``held()`` counts offers not yet released.

Deadlines: the sender holds an offer ``hold_s`` seconds. The handle carries the
wall-clock ``expires_at``; a receiver starts only if it can finish (its own
``timeout_s``) before that, so a late reader never reads blocks the prefill
engine has reused. This assumes clocks in sync across nodes (NTP).

Errors, by what the caller should do:
- ``TransferFailed``: this request's transfer failed (timeout, abort, peer lost,
  checksum, expired). Retry the request (the gateway re-prefills it); the node
  lives on. Also raised by ``offer``/``start`` when a request cannot begin.
- ``TransportDead``: the backend itself is unusable (cannot create the NIXL
  agent, cannot listen). Use another backend or take the node out of service.
- ``ValueError``: a caller bug (bad block ids, layout mismatch).
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from compute.kv_transfer.handle import HANDLE_VERSION, KVHandle
from compute.kv_transfer.layout import BlockRegion, KVLayout, KVPool  # noqa: F401  (re-exported)
from compute.kv_transfer.ledger import Hold, ReceiverLedger, SenderLedger, Transfer

log = logging.getLogger(__name__)


class TransferState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # offered / started, no bytes moved yet
    TRANSFERRING = "transferring"  # bytes moving
    DONE = "done"  # sender: receiver confirmed; receiver: KV is in the destination blocks
    FAILED = "failed"  # see failure() for the reason

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class KVTransferError(Exception):
    """Base of every error the transfer layer raises on purpose."""


class TransferFailed(KVTransferError):
    """One request's transfer failed; retrying the request may succeed."""

    def __init__(self, request_id: str, reason: str, detail: str = ""):
        super().__init__(f"KV transfer of {request_id!r} failed: {reason}" + (f" ({detail})" if detail else ""))
        self.request_id, self.reason, self.detail = request_id, reason, detail


class TransportDead(KVTransferError):
    """The backend is unusable in this process; retrying on it is useless."""


ReleaseCallback = Callable[[str, list[int], TransferState], None]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one receiver transfer moved."""

    state: TransferState
    reason: str  # "" unless FAILED
    nbytes: int  # KV bytes delivered into the cache (uncompressed size)
    wire_nbytes: int  # bytes that crossed the transport
    seconds: float  # start() to terminal state

    @property
    def saved_nbytes(self) -> int:
        return self.nbytes - self.wire_nbytes


class KVSender(abc.ABC):
    """Prefill side: offers a request's blocks and holds them until released.

    Thread-safe. Backends implement ``offer`` and ``close`` and may hook
    ``_on_released`` (free staging) and ``_progress`` (drive the transport).
    """

    backend: str = "?"

    def __init__(self, pool: KVPool, hold_s: float, timeout_s: float, on_release: ReleaseCallback | None = None):
        self.pool, self.layout, self.timeout_s = pool, pool.layout, timeout_s
        self._ledger = SenderLedger(hold_s, stream_s=2 * timeout_s)
        self._on_release = on_release
        self._closed = threading.Event()

    # ---- engine-facing verbs ---------------------------------------------------------------

    @abc.abstractmethod
    def offer(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """Hold the blocks of ``request_id`` and return a JSON-serializable handle.

        ``block_ids`` list the request's blocks in position order; the first
        ``ceil(num_tokens / block_size)`` are sent. The engine must not reuse
        ``block_ids`` until ``on_release`` reports them. The handle names the
        backend, the peer address / metadata and the descriptors a receiver
        needs. Raises ``TransferFailed`` when the offer cannot be held now (for
        instance staging full: retry later), ``ValueError`` on bad ids or a
        duplicate ``request_id``, ``TransportDead`` after ``close``.
        """

    def poll(self, request_id: str) -> TransferState:
        """State of an offer; terminal states stay readable for a while after release.

        BOOTSTRAPPING until a receiver starts (nixl READs are one-sided: it may
        go straight to DONE), DONE once the receiver confirmed, FAILED on abort
        or deadline. Also releases offers whose deadline passed. ``KeyError``
        for a request never offered (or long forgotten).
        """
        self._progress()
        self._expire()
        return TransferState(self._ledger.state(request_id))

    def failure(self, request_id: str) -> TransferFailed | None:
        """Why an offer FAILED (a ``TransferFailed`` to raise or report), else None."""
        h = self._ledger.get(request_id)
        if h is None or h.state != TransferState.FAILED.value:
            return None
        return TransferFailed(request_id, h.reason)

    def release(self, request_id: str) -> None:
        """Stop holding ``request_id`` now (early free); idempotent, unknown ids ignored.

        Called by the sender itself on confirmation or deadline; the engine may
        call it too. A transfer already streaming is allowed to finish first
        (release happens at its end); otherwise the offer ends FAILED('released').
        """
        self._end(request_id, "released", cut=False)

    def abort(self, request_id: str) -> None:
        """Cancel the offer: FAILED('aborted'), a running stream is cut, blocks released."""
        self._end(request_id, "aborted", cut=True)

    def held(self) -> int:
        """Number of offers whose blocks are still held (0 == nothing leaks)."""
        self._expire()
        return self._ledger.held()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving; every held offer ends FAILED('closed') and is released."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- for backends ---------------------------------------------------------------------

    def _hold(self, request_id: str, block_ids: list[int], num_tokens: int) -> Hold:
        """Validate and register a new hold (the backend fills ``hold.extra``)."""
        if self._closed.is_set():
            raise TransportDead(f"{self.backend} sender is closed")
        blocks = self.pool.check_blocks(block_ids)
        n = self.layout.num_blocks_for(num_tokens)
        if num_tokens <= 0 or n > len(blocks):
            raise ValueError(f"{num_tokens} tokens need {n} blocks, got {len(blocks)}")
        return self._ledger.add(request_id, blocks, n, num_tokens)

    def _handle(self, cls: type[KVHandle], hold: Hold, codec: str, **backend) -> KVHandle:
        """The offer's handle: ``cls`` (the backend's) with the hold's fields and the backend's own."""
        return cls(request_id=hold.request_id, layout=self.layout.to_dict(), num_tokens=hold.num_tokens,
                   num_blocks=hold.n, nbytes=hold.n * self.layout.bytes_per_block, wire_nbytes=hold.wire_nbytes,
                   codec=codec, expires_at=hold.expires_at, **backend)  # fmt: skip

    def _finish(self, request_id: str, state: TransferState, reason: str = "") -> None:
        """End a hold (first call wins), then free backend resources and tell the engine."""
        from compute.kv_transfer import metrics

        h = self._ledger.finish(request_id, state.value, reason)
        if h is None:
            return
        if state == TransferState.FAILED:
            metrics.FAILURES.labels(self.backend, reason or "error").inc()
        else:
            metrics.BYTES.labels(self.backend, "sent").inc(h.wire_nbytes)
        try:
            self._on_released(h)
        finally:
            if self._on_release is not None:
                try:
                    self._on_release(request_id, h.block_ids, state)
                except Exception:  # the engine's callback must not break the transport
                    log.exception("on_release(%s) raised", request_id)

    def _end(self, request_id: str, reason: str, cut: bool) -> None:
        h = self._ledger.get(request_id)
        if h is None or h.terminal:
            return
        if h.state == TransferState.TRANSFERRING.value:
            h.cut = h.cut or cut
            h.ending = reason  # the stream finishes the hold when it stops
            return
        self._finish(request_id, TransferState.FAILED, reason)

    def _expire(self) -> None:
        for rid in self._ledger.expired():
            self._finish(rid, TransferState.FAILED, "expired")

    def _close_all(self) -> None:
        for rid in self._ledger.held_ids():
            self._finish(rid, TransferState.FAILED, "closed")

    def _on_released(self, hold: Hold) -> None:
        """Backend hook: free what the hold used besides the blocks (staging)."""

    def _progress(self) -> None:
        """Backend hook: drive the transport (read notifications)."""


class KVReceiver(abc.ABC):
    """Decode side: pulls an offered request's KV into preallocated blocks."""

    backend: str = "?"

    def __init__(self, pool: KVPool, timeout_s: float):
        self.pool, self.layout, self.timeout_s = pool, pool.layout, timeout_s
        self._ledger = ReceiverLedger()

    @abc.abstractmethod
    def start(self, handle: KVHandle, dst_block_ids: list[int], first_block: int = 0) -> str:
        """Begin receiving ``handle``'s KV into ``dst_block_ids``; returns a transfer id.

        ``dst_block_ids`` are the decode engine's blocks in position order (at
        least ``handle.num_blocks``). ``first_block``: the receiver already
        holds blocks ``[0, first_block)`` (its own prefix cache's hit): only
        blocks ``[first_block, num_blocks)`` cross the wire, into
        ``dst_block_ids[first_block:num_blocks]``. The written blocks must stay
        allocated until the transfer is terminal. Never blocks on the network.
        ``ValueError`` on a handle of another backend or layout, bad ids or a
        ``first_block`` out of ``[0, num_blocks]``; ``TransferFailed`` if the
        transfer cannot begin (expired handle).
        """

    def poll(self, transfer_id: str) -> TransferState:
        """State of a transfer: BOOTSTRAPPING -> TRANSFERRING -> DONE | FAILED.

        DONE means the KV is in the destination blocks, bit-exact (or decoded,
        with compression). A transfer not terminal within ``timeout_s`` of
        ``start`` becomes FAILED('timeout'): the caller never waits longer.
        """
        t = self._ledger.get(transfer_id)
        if t is None:
            raise KeyError(transfer_id)
        if not t.terminal:
            self._advance(t)
        return TransferState(t.state)

    def failure(self, transfer_id: str) -> TransferFailed | None:
        """Why a transfer FAILED (a retryable ``TransferFailed``), else None."""
        t = self._ledger.get(transfer_id)
        if t is None or t.state != TransferState.FAILED.value:
            return None
        return TransferFailed(t.request_id, t.reason)

    def stats(self, transfer_id: str) -> TransferStats:
        t = self._ledger.get(transfer_id)
        if t is None:
            raise KeyError(transfer_id)
        return TransferStats(TransferState(t.state), t.reason, t.nbytes, t.wire_nbytes, t.seconds)

    @abc.abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Stop a transfer: FAILED('aborted'); once it returns, the destination blocks
        are no longer written and the sender is told (it releases its hold).
        Idempotent; terminal transfers are left as they are."""

    def active(self) -> int:
        """Transfers not yet terminal."""
        return self._ledger.active()

    def close(self) -> None:
        """Abort every active transfer."""
        for tid in self._ledger.active_ids():
            self.abort(tid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- for backends ---------------------------------------------------------------------

    def _check_handle(self, handle: KVHandle, dst_block_ids: list[int], first_block: int = 0) -> list[int]:
        """The destination blocks written: ``dst_block_ids[first_block:num_blocks]``."""
        if not isinstance(handle, KVHandle) or handle.backend != self.backend or handle.version != HANDLE_VERSION:
            raise ValueError(f"handle for {getattr(handle, 'backend', type(handle).__name__)!r} "
                             f"v{getattr(handle, 'version', '?')} given to a {self.backend} receiver")  # fmt: skip
        try:
            layout = KVLayout.from_dict(handle.layout)
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad layout {handle.layout}: {e}") from None
        if layout != self.layout:
            raise ValueError(f"layout mismatch: sender {handle.layout} vs receiver {self.layout.to_dict()}")
        dst = self.pool.check_blocks(dst_block_ids)
        if len(dst) < handle.num_blocks:
            raise ValueError(f"need {handle.num_blocks} destination blocks, got {len(dst)}")
        if not 0 <= first_block <= handle.num_blocks:
            raise ValueError(f"first_block {first_block} out of [0, {handle.num_blocks}]")
        return dst[first_block : handle.num_blocks]

    def _new(self, handle: KVHandle, dst: list[int], first_block: int = 0) -> Transfer:
        """Register a transfer of ``dst`` (blocks ``[first_block, num_blocks)``: its bytes are that share of
        the handle's); FAILED('expired') at once if it could not finish before the sender's deadline (then it
        never touches the sender's blocks)."""
        n, k = handle.num_blocks, len(dst)
        t = self._ledger.add(handle.request_id, dst, self.timeout_s, handle.nbytes * k // n,
                             handle.wire_nbytes * k // n)  # fmt: skip
        t.first = first_block
        if time.time() + self.timeout_s > handle.expires_at:
            self._finish(t, TransferState.FAILED, "expired")
        return t

    def _finish(self, t: Transfer, state: TransferState, reason: str = "") -> bool:
        from compute.kv_transfer import metrics

        if not self._ledger.finish(t, state.value, reason):
            return False
        if state == TransferState.FAILED:
            metrics.FAILURES.labels(self.backend, reason or "error").inc()
        else:
            metrics.BYTES.labels(self.backend, "received").inc(t.wire_nbytes)
            metrics.SECONDS.labels(self.backend).observe(t.seconds)
            if t.nbytes > t.wire_nbytes:
                metrics.SAVED.labels(self.backend).inc(t.nbytes - t.wire_nbytes)
        return True

    def _advance(self, t: Transfer) -> None:
        """Backend hook run by poll on a live transfer; the default enforces the deadline."""
        if t.overdue():
            self._finish(t, TransferState.FAILED, "timeout")


def wait(poll: Callable[[str], TransferState], key: str, timeout_s: float, interval_s: float = 0.001) -> TransferState:
    """Poll until terminal or ``timeout_s`` (returns the last state). For tests and tools."""
    end = time.monotonic() + timeout_s
    while True:
        s = poll(key)
        if s.terminal or time.monotonic() >= end:
            return s
        time.sleep(interval_s)
