"""A node's two KV transfer ends, made for its role: the sender offers blocks (a prefill's KV, a peer export),
the receiver pulls them into this node's blocks (a decode node's handoff, a peer pull or pre-pull).

Lifecycle: ``compute/node/held.py`` makes the ends a model's service needs when it loads (``make_sender`` for
prefill, ``make_receiver`` for decode, both with ``peer_kv``) and closes them with it; ``receive_kv`` is the one
pull loop every receiving path shares. The sender's ``on_release`` (the receiver confirmed, an abort, or
``kv_hold_s`` passed) lets go of the held blocks on the engine thread: nothing is leaked.
"""

from __future__ import annotations

import asyncio
import time

from compute.kv_transfer.handle import KVHandle
from compute.node.errors import BadNodeRequest, TransferFailed


def make_sender(svc, layout, cache_tensor) -> None:
    """``svc.sender``: offers held blocks; its releases free them (``svc.held``: request id -> held key)."""
    from compute.kv_transfer import make_transfer

    def on_release(request_id: str, block_ids: list[int], state) -> None:
        key = svc.held.pop(request_id, None)
        if key is not None:
            svc.worker.post(lambda e: e.release(key))

    cfg = svc.config
    svc.sender = make_transfer(cfg.kv_transport, "prefill", layout, cache_tensor, on_release=on_release,
                               host=cfg.host, hold_s=cfg.kv_hold_s, timeout_s=cfg.kv_timeout_s,
                               compression=cfg.kv_compression)  # fmt: skip


def make_receiver(svc, layout, cache_tensor) -> None:
    from compute.kv_transfer import make_transfer

    cfg = svc.config
    svc.receiver = make_transfer(cfg.kv_transport, "decode", layout, cache_tensor, host=cfg.host,
                                 hold_s=cfg.kv_hold_s, timeout_s=cfg.kv_timeout_s)  # fmt: skip


def make_ends(svc, layout, cache_tensor) -> None:
    """The ends this node lacks for its role, so it can export and pull prefixes (compute/node/peer.py)."""
    if svc.sender is None:
        make_sender(svc, layout, cache_tensor)
    if svc.receiver is None:
        make_receiver(svc, layout, cache_tensor)


async def receive_kv(svc, handle: KVHandle, blocks: list[int], rid: str, first: int = 0) -> None:
    """Pull a peer's KV named by ``handle`` into this node's ``blocks`` (from token block ``first``), polling until it
    lands: a bad handle is ``BadNodeRequest``, a transfer that fails or outlives ``kv_timeout_s`` is ``TransferFailed``
    (retry elsewhere) and is aborted. The decode handoff and the peer pull/import share it."""
    from compute.kv_transfer import TransferState

    try:
        tid = svc.receiver.start(handle, blocks, first)
    except ValueError as e:
        raise BadNodeRequest(f"bad KV handle: {e}") from None
    except Exception as e:  # noqa: BLE001 - TransferFailed (expired...) : retry elsewhere
        raise TransferFailed(f"KV transfer could not start: {e}") from None
    deadline = time.monotonic() + svc.config.kv_timeout_s + 1.0
    try:
        while True:
            state = svc.receiver.poll(tid)
            if state is TransferState.DONE:
                return
            if state is TransferState.FAILED:
                raise TransferFailed(f"KV transfer failed: {svc.receiver.failure(tid)}")
            if time.monotonic() > deadline:
                raise TransferFailed("KV transfer timed out")
            await asyncio.sleep(0.001)
    except BaseException:
        svc.receiver.abort(tid)
        raise
