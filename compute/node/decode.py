"""Decode role: a KV handle and the first token in, the rest of the answer streamed out.

Lifecycle of a request on a decode node:
 1. POST /internal/decode with the prompt, the first token and the prefill node's KV handle;
 2. the engine thread allocates blocks for the prompt's KV (``scheduler.add_imported``: the
    sequence is IMPORTING, never scheduled); no room -> 503 (the gateway tries elsewhere);
 3. the KV receiver pulls the prefill node's blocks into them (``start``, then ``poll`` until
    DONE or FAILED within ``kv_timeout_s``); the prefill side is told and frees its copy;
 4. FAILED: the sequence is aborted (blocks freed) and the request answered 503 with the
    reason — only this request fails, and the gateway re-prefills it on a healthy pair;
 5. DONE: ``activate`` — the sequence joins the running batch as a decode, its first step
    computes the first token's KV and samples the second; outputs stream as NDJSON lines;
 6. a client that goes away aborts it; blocks return to the free list in every case.
"""

from __future__ import annotations

import asyncio
import time

from compute.errors import CacheFull, RequestTooLarge
from compute.engine.sequence import Sequence

from compute.node.protocol import DecodeRequest
from compute.node.service import (
    Active,
    BadNodeRequest,
    NodeBusy,
    NodeService,
    TransferFailed,
    check_request,
    constrain,
    prompt_len,
    sampling_params,
)


def make_receiver(svc: NodeService, layout, cache_tensor) -> None:
    from compute.kv_transfer import make_transfer

    cfg = svc.config
    svc.receiver = make_transfer(cfg.kv_transport, "decode", layout, cache_tensor, host=cfg.host,
                                 hold_s=cfg.kv_hold_s, timeout_s=cfg.kv_timeout_s)  # fmt: skip


async def decode(svc: NodeService, msg: DecodeRequest):
    """-> (request id, output queue) once the KV has landed; raises NodeBusy/BadNodeRequest."""
    svc.check_accepting()
    check_request(msg)
    rid, prompt, first, handle = msg.request_id, msg.prompt_token_ids, msg.first_token_id, msg.kv
    if not handle:
        raise BadNodeRequest("decode needs first_token_id (int) and kv (the prefill handle)")
    svc.check_tokens(prompt + [first])
    seq = Sequence(prompt + [first], sampling_params(msg))
    seq.prompt_len = prompt_len(msg)  # the first token (from the prefill node) is output
    seq.matcher = constrain(svc.grammars, seq.params, seq.token_ids[seq.prompt_len :])
    if rid in svc.active:
        raise BadNodeRequest(f"duplicate request_id {rid!r}")
    try:
        blocks = await svc.worker.call(lambda e: e.scheduler.add_imported(seq, len(prompt)))
    except RequestTooLarge as e:
        raise BadNodeRequest(str(e)) from None
    except CacheFull as e:
        raise NodeBusy(str(e)) from None
    q = svc.worker.open_stream(seq.seq_id)
    svc.active[rid] = Active(seq.seq_id, time.monotonic(), "decode")
    try:
        await _receive(svc, handle, blocks, rid)
        await svc.worker.call(lambda e: e.scheduler.activate(seq.seq_id))
    except BaseException:
        svc.abort(rid)
        raise
    return rid, q


async def _receive(svc: NodeService, handle: dict, blocks: list[int], rid: str) -> None:
    from compute.kv_transfer import TransferState

    try:
        tid = svc.receiver.start(handle, blocks)
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
