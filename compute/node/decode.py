"""Decode role: a KV handle and the first token in, the rest of the answer streamed out.

Lifecycle of a request on a decode node:
 1. POST /internal/decode with the prompt, the first token and the prefill node's KV handle;
 2. the engine thread allocates blocks for the prompt's KV (``Engine.import_prompt``: the
    sequence is IMPORTING, never scheduled), its table starting with this node's own cached
    blocks of the prompt (k of them: an earlier turn's prompt it imported); no room -> 503
    (the gateway tries elsewhere);
 3. the KV receiver pulls the prefill node's blocks [k, n) into the rest (``start`` with
    ``first_block=k``, then ``poll`` until DONE or FAILED within ``kv_timeout_s``): only what
    this node lacks crosses the wire; the prefill side is told and frees its copy;
 4. FAILED: the sequence is aborted (blocks freed) and the request answered 503 with the
    reason — only this request fails, and the gateway re-prefills it on a healthy pair;
 5. DONE: ``activate`` — the imported prompt blocks the prefill node computed by prefill (its
    handle's ``cacheable_blocks``) are cached here by their hashes (never the decoded answer's:
    decode-path numbers); the sequence joins the running batch as a decode, its first step
    computes the first token's KV and samples the second; outputs stream as NDJSON lines;
 6. a client that goes away aborts it; blocks return to the free list in every case.
"""

from __future__ import annotations

import time

from compute.engine.sequence import Sequence
from compute.errors import CacheFull, RequestTooLarge
from compute.node.errors import BadNodeRequest, NodeBusy
from compute.node.kv_ends import receive_kv
from compute.node.protocol import DecodeRequest
from compute.node.service import Active, NodeService, check_request, prompt_len, sampling_params


async def decode(svc: NodeService, msg: DecodeRequest):
    """-> (request id, output queue) once the KV has landed; raises NodeBusy/BadNodeRequest."""
    svc.check_accepting()
    check_request(msg)
    rid, prompt, first, handle = msg.request_id, msg.prompt_token_ids, msg.first_token_id, msg.kv
    svc.check_tokens(prompt + [first])
    seq = Sequence(prompt + [first], sampling_params(msg))
    seq.prompt_len = prompt_len(msg)  # the first token (from the prefill node) is output
    if rid in svc.active:
        raise BadNodeRequest(f"duplicate request_id {rid!r}")
    await svc.prepare(seq)
    seq.landing = True  # an abort while the KV lands keeps its blocks until the transfer is over
    try:
        cacheable = handle.cacheable_blocks if handle.codec == "none" else 0  # lossy KV: not a prefill's numbers
        blocks, first = await svc.worker.call(lambda e: e.import_prompt(seq, len(prompt), cacheable))
    except RequestTooLarge as e:
        svc.unpin(seq.seq_id)
        raise BadNodeRequest(str(e)) from None
    except CacheFull as e:
        svc.unpin(seq.seq_id)
        raise NodeBusy(str(e)) from None
    q = svc.worker.open_stream(seq.seq_id)
    svc.active[rid] = Active(seq.seq_id, time.monotonic(), "decode")
    try:
        await receive_kv(svc, handle, blocks, rid, first)
        await svc.worker.call(lambda e: e.activate(seq.seq_id))
    except BaseException:
        svc.abort(rid)
        raise
    finally:
        svc.worker.post(lambda e: e.transfer_ended(seq))  # after the abort above: FIFO on the engine thread
    return rid, q
