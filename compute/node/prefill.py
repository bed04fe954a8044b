"""Prefill role: a prompt in, its first token and a handle to its KV cache out.

Lifecycle of a request on a prefill node:
 1. POST /internal/prefill -> the prompt becomes a ``Sequence`` with ``hold_kv`` and
    max_tokens 1, queued on the engine (chunked prefill shares steps with others);
 2. the engine computes the prompt's KV and samples the first token; the sequence
    finishes but its blocks are *held* (``Engine.held_blocks``), not freed;
 3. the KV sender ``offer``s those blocks and returns a handle (backend, peer address
    or NIXL metadata, descriptors) beside the first token — the gateway passes the
    handle to a decode node;
 4. the decode node pulls the blocks it lacks (NIXL READ / TCP: those past its own cached
    prefix of the prompt; the handle's ``cacheable_blocks`` says which it may cache) and confirms; the sender's
    ``on_release`` fires, and the blocks go back to the free list on the engine thread;
 5. no confirmation within ``kv_hold_s``, an abort, or the first token already ending
    the request (EOS, max_tokens 1): the blocks are released the same way. No leak.
"""

from __future__ import annotations

import time

from compute.node.errors import BadNodeRequest, TransferFailed
from compute.node.metrics import TTFT
from compute.node.peer import puller
from compute.node.protocol import GenerateRequest, PrefillReply
from compute.node.service import NodeService, check_request, new_sequence, output_line, sampling_params


async def prefill(svc: NodeService, msg: GenerateRequest) -> PrefillReply:
    svc.check_accepting()
    check_request(msg)
    rid, prompt = msg.request_id, msg.prompt_token_ids
    svc.check_tokens(prompt)
    want = sampling_params(msg)  # the whole request's limits (validated here)
    seq = new_sequence(msg, sampling_params(msg, max_tokens=1))
    seq.hold_kv = True
    # the context check must cover the whole request, not just this first token
    if len(prompt) + want.max_tokens > svc.engine.max_len:
        raise BadNodeRequest(f"prompt {len(prompt)} + max_tokens {want.max_tokens} exceeds {svc.engine.max_len}")
    await svc.prepare(seq)
    started = time.monotonic()
    q = await svc.add(rid, seq, "prefill", puller(msg.pull))
    try:
        out = await q.get()
    finally:
        svc.finish(rid)
    if out.new_token_ids:  # the request's first token: its TTFT is measured here (the decode node's is its own)
        TTFT.labels(svc.config.model).observe(time.monotonic() - started)
    if out.finish_reason in ("error", "abort"):
        return PrefillReply([], out.finish_reason, error=out.error)
    line = output_line(out)  # the first token, its logprobs and the prompt's, if asked
    reply = PrefillReply(line.token_ids, None, line.logprobs, line.prompt_logprobs, line.error,
                         cached_tokens=line.cached_tokens)  # fmt: skip
    ended = out.finish_reason == "stop" or want.max_tokens == 1
    if ended:
        svc.worker.post(lambda e: e.release(seq.seq_id))
        reply.finish_reason = out.finish_reason if out.finish_reason == "stop" else "length"
        return reply
    blocks = await svc.worker.call(lambda e: e.held_blocks(seq.seq_id))
    svc.held[rid] = seq.seq_id
    try:
        reply.kv = svc.sender.offer(rid, blocks, len(prompt))
        # the leading full blocks computed here by prefill (or hit): a decode node may cache those, not the rest
        reply.kv.cacheable_blocks = min(seq.num_published, seq.cache_stop // svc.engine.block_size)
    except Exception as e:  # noqa: BLE001 - TransferFailed/TransportDead: this request only
        svc.held.pop(rid, None)
        svc.worker.post(lambda e: e.release(seq.seq_id))
        raise TransferFailed(f"cannot offer KV: {e}") from None
    return reply
