"""Peer pull: a node reads a prompt prefix's KV blocks from another node's prefix cache.

Lifecycle of one pull (the gateway arranges it: gateway/routing/relay.py):
 1. the gateway's prefix index says node A holds h blocks of a prompt and the node chosen for it, B, fewer;
    pulling them is cheaper than computing them (gateway/routing/router.py ``PullCost``): it asks A
    POST /internal/kv/export with the prompt (and its cache_salt);
 2. A (``export``) hashes the prompt as its engine does, pins its cached run (``Engine.pin_cached``: the
    blocks can be neither evicted nor reused) and ``offer``s them on its KV sender; the handle carries their
    hashes. The pin ends on the receiver's confirmation, an abort, or ``kv_hold_s`` (the sender's ledger),
    as a prefill node's held KV does: nothing leaks;
 3. the gateway passes the handle to B inside the request (``GenerateRequest.pull``); B (``pull_then_add``,
    through ``puller``)
    checks that the handle's hashes are its own for this prompt (same model, weights, KV dtype, block size
    and salt: the chained hash covers them), allocates the blocks, its own cached ones first
    (``Engine.add_pull``), receives the others [k, h) through its KV receiver exactly as a decode node
    does, names them by their hashes (``admit_pulled``) and queues the request, which computes only the
    rest of its prompt; its ``cached_tokens`` count the pulled ones;
 4. anything wrong (no room, a handle refused, A gone, the offer expired, a timeout, a layout or hash
    mismatch, lossy wire compression): the blocks are freed and the request is added as any other — it
    computes its prompt. A pull never fails a request; each fallback is counted by its reason.

Pre-pull (a node joining the pool): the gateway asks a holder to export a hot chain by its block hashes (no token
ids) and hands the handle to the new node's POST /internal/kv/import (``import_chain``): the blocks land in its
cache under the exporter's hashes (a peer is trusted as the gateway is: every internal request is signed), with
no request attached; the requests that follow hit them.

Under ``kernels = invariant`` the pulled KV has the numbers B would compute (A computed them by prefill
with the same row-invariant kernels), so the answer equals a recompute's (tests/compute/node/test_peer.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from compute.engine.sequence import Sequence
from compute.errors import CacheFull, RequestTooLarge
from compute.node import metrics
from compute.node.errors import BadNodeRequest, NodeBusy, TransferFailed
from compute.node.kv_ends import receive_kv
from compute.node.protocol import ExportReply, ExportRequest, KVHandle
from compute.node.service import NodeService

log = logging.getLogger("pdserve.node")


class NothingCached(NodeBusy):
    """The prefix asked for is not cached here (evicted since the gateway's index saw it): pull from no one."""

    kind = "overloaded"


async def export(svc: NodeService, msg: ExportRequest) -> ExportReply:
    """Pin this node's cached blocks of the prefix and offer them: the handle a peer pulls them with."""
    svc.check_accepting()
    if svc.sender is None or not svc.config.prefix_cache:
        raise NodeBusy("this node exports no KV (peer_kv off, no prefix cache, or a device other than cpu)")
    if msg.block_hashes:
        hashes = msg.block_hashes
    elif msg.prompt_token_ids:
        svc.check_tokens(msg.prompt_token_ids)
        hashes = svc.engine.prompt_hashes(msg.prompt_token_ids, msg.cache_salt)
    else:
        raise BadNodeRequest("export needs prompt_token_ids or block_hashes")
    if msg.max_blocks > 0:
        hashes = hashes[: msg.max_blocks]
    key, blocks = await svc.worker.call(lambda e: e.pin_cached(hashes))
    if not blocks:
        raise NothingCached("no block of this prefix is cached here")
    xid = f"export-{uuid.uuid4().hex}"
    svc.held[xid] = key  # the sender's on_release frees the pin (compute/node/prefill.py make_sender)
    try:
        kv = svc.sender.offer(xid, blocks, len(blocks) * svc.engine.block_size)
    except Exception as e:  # noqa: BLE001 - TransferFailed / TransportDead: this export only
        svc.held.pop(xid, None)
        svc.worker.post(lambda e: e.release(key))
        raise TransferFailed(f"cannot offer the cached KV: {e}") from None
    kv.block_hashes, kv.cacheable_blocks = list(hashes[: len(blocks)]), len(blocks)
    metrics.PEER_EXPORTS.labels(svc.config.model).inc()
    metrics.PEER_EXPORTED_BLOCKS.labels(svc.config.model).inc(len(blocks))
    return ExportReply(kv, len(blocks))


def _refusal(svc: NodeService, seq: Sequence, handle: KVHandle) -> str | None:
    """Why this node will not pull ``handle`` for ``seq`` (a fallback reason), or None."""
    if svc.receiver is None or not svc.config.prefix_cache:
        return "off"
    p = seq.params
    if p.prompt_logprobs is not None or p.fork_group or seq.replay_from is not None:
        return "unsupported"  # computes every prompt row / forks from a leader / replays output one token a step
    n = handle.num_blocks
    if len(handle.block_hashes) != n:
        return "bad_handle"  # not an export: its blocks are not named
    if handle.codec != "none":
        return "lossy"  # compressed on the wire: not the numbers a prefill makes, never cached
    mine = svc.engine.prompt_hashes(seq.token_ids[: seq.prompt_len], p.hash_salt)
    if mine[:n] != handle.block_hashes:
        return "mismatch"  # another model, weights, KV dtype, block size or salt: its blocks are not this prompt's
    return None


def puller(handle: KVHandle | None):
    """How ``NodeService.add`` queues a request that carries a peer's export (None: as any request)."""
    if not handle:
        return None
    return lambda svc, rid, seq: pull_then_add(svc, rid, seq, handle)


async def pull_then_add(svc: NodeService, rid: str, seq: Sequence, handle: KVHandle) -> None:
    """Queue ``seq`` (registered in ``svc.active``) starting from the prefix a peer offered in ``handle``;
    on any failure, queue it to compute its prompt (``RequestTooLarge`` propagates as ``add``'s does)."""
    model = svc.config.model
    reason = _refusal(svc, seq, handle)
    if reason is None:
        bs = svc.engine.block_size
        n = handle.num_blocks
        seq.landing = True  # an abort while the blocks land keeps them until the transfer is over
        try:
            blocks, k = await svc.worker.call(lambda e: e.add_pull(seq, n * bs))
        except (CacheFull, RequestTooLarge):
            reason = "no_room"
        else:
            reason = await _land(svc, rid, seq, handle, blocks, k)
            if reason is None:
                metrics.PEER_PULLED_BLOCKS.labels(model).inc(n - k)
                metrics.PEER_PULLED_BYTES.labels(model).inc(handle.share(k))
                return
    log.info("request %s: no pull from the peer (%s): computing its prompt", rid, reason)
    metrics.PEER_PULL_FALLBACKS.labels(model, reason).inc()
    svc.pull_fallbacks += 1
    await svc.worker.call(lambda e: e.add(seq))


async def _land(svc: NodeService, rid: str, seq: Sequence, handle: KVHandle, blocks: list[int], k: int) -> str | None:
    """Receive blocks [k, n) into ``blocks`` and queue ``seq``: None, or why not (its blocks are then freed)."""
    try:
        await receive_kv(svc, handle, blocks, rid, k)
    except asyncio.CancelledError:
        svc.worker.post(lambda e: e.cancel_pull(seq.seq_id))
        raise
    except (TransferFailed, BadNodeRequest) as e:
        gone = await svc.worker.call(lambda e: e.cancel_pull(seq.seq_id) is None)
        if gone:  # aborted meanwhile (the client left): nothing to compute
            raise NodeBusy(f"request {rid} was aborted") from None
        return "transfer_failed" if isinstance(e, TransferFailed) else "bad_handle"
    finally:
        svc.worker.post(lambda e: e.transfer_ended(seq))  # frees the blocks of one aborted meanwhile
    if not await svc.worker.call(lambda e: e.admit_pulled(seq.seq_id)):
        raise NodeBusy(f"request {rid} was aborted")
    return None


async def import_chain(svc: NodeService, handle: KVHandle) -> int:
    """Pull a peer's export into this node's prefix cache (a pre-pull); -> the blocks newly cached here.
    ``TransferFailed`` (503) if the pull fails, ``NodeBusy`` if there is no room, ``BadNodeRequest`` on a bad handle."""
    svc.check_accepting()
    if svc.receiver is None or not svc.config.prefix_cache:
        raise NodeBusy("this node pulls no KV (peer_kv off, no prefix cache, or a device other than cpu)")
    n, hashes = handle.num_blocks, handle.block_hashes
    if len(hashes) != n or handle.codec != "none":
        raise BadNodeRequest("kv must be an uncompressed export: num_blocks and as many block_hashes")
    try:
        key, blocks, k = await svc.worker.call(lambda e: e.pin_for_import(hashes))
    except CacheFull as e:
        raise NodeBusy(str(e)) from None
    try:
        await receive_kv(svc, handle, blocks, f"import-{key}", k)
    except BaseException:
        svc.worker.post(lambda e: e.release(key))
        raise
    named = await svc.worker.call(lambda e: e.land_import(key, hashes, k))
    metrics.PEER_PULLED_BLOCKS.labels(svc.config.model).inc(n - k)
    metrics.PEER_PULLED_BYTES.labels(svc.config.model).inc(handle.share(k))
    return named
