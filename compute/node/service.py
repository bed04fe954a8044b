"""One held model's state between HTTP and its engine thread: requests in flight, load, metrics, drain.

A node runtime holds one ``NodeService`` per loaded model (``models.ModelHost``); ``config.model``
is that model's name.

Lifecycle of a `both` request (``generate``): parse -> Sequence -> stream opened ->
``Engine.add`` on the engine thread (``RequestTooLarge`` -> 400) -> StepOutputs
relayed as NDJSON lines -> finished; a client that goes away aborts the sequence
(its blocks are freed). The prefill and decode halves live in ``prefill.py`` and
``decode.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from compute.engine.sampling import SamplingParams
from compute.engine.sequence import Sequence
from compute.errors import RequestTooLarge
from compute.node import protocol as P
from compute.node.cache_feed import CacheFeed
from compute.node.config import NodeConfig
from compute.node.errors import BadNodeRequest, NodeBusy
from compute.node.metrics import FINISHED, REQUEST_SECONDS, TPOT, TTFT, start_series
from compute.node.protocol import GenerateRequest, StreamLine, encode_line
from compute.node.worker import EngineWorker


@dataclass(slots=True)
class Active:
    seq_id: int
    started: float
    kind: str  # generate | prefill | decode


def sampling_params(msg: GenerateRequest, max_tokens: int | None = None) -> SamplingParams:
    """The engine's parameters of a request (checked as it was decoded), ``max_tokens`` overriding its own."""
    return msg.params if max_tokens is None else msgspec.structs.replace(msg.params, max_tokens=max_tokens)


def prompt_len(msg: GenerateRequest) -> int:
    """Where the request's own prompt ends: ``output_tokens`` trailing tokens are earlier output."""
    n, prompt = msg.output_tokens, msg.prompt_token_ids
    if not 0 <= n < len(prompt):
        raise BadNodeRequest("output_tokens must be an int in [0, len(prompt))")
    return len(prompt) - n


def logprobs_json(lps: list | None) -> list | None:
    """Logprobs on the wire: per token ``[logprob, [[id, logprob], ...]]`` or null (None if there are none)."""
    if not lps:
        return None
    return [None if lp is None else [lp.logprob, [list(t) for t in lp.top]] for lp in lps]


def output_line(o) -> StreamLine:
    """One step output as a stream line (prompt logprobs ride on the first token's line)."""
    return StreamLine(o.new_token_ids, o.finish_reason, logprobs_json(o.logprobs) if o.logprobs else None,
                      None if o.prompt_logprobs is None else logprobs_json(o.prompt_logprobs), o.error or None,
                      o.cached_tokens)  # fmt: skip


def new_sequence(msg: GenerateRequest, sp: SamplingParams) -> Sequence:
    """A sequence whose last ``msg.replay_tokens`` prompt tokens are replayed output (failover); its grammar's
    matcher and adapter, if it asks for them, come from ``NodeService.prepare``."""
    prompt = msg.prompt_token_ids
    seq = Sequence(prompt, sp)
    seq.prompt_len = prompt_len(msg)
    replay = msg.replay_tokens
    if replay:
        if not 0 < replay < len(prompt):
            raise BadNodeRequest("replay_tokens must be in [0, len(prompt))")
        seq.replay_from = len(prompt) - replay
    return seq


def check_request(msg: GenerateRequest) -> None:
    if not msg.request_id:
        raise BadNodeRequest("request_id must be a non-empty string")
    if not msg.prompt_token_ids:
        raise BadNodeRequest("prompt_token_ids must be a non-empty list of ints")


class NodeService:
    def __init__(self, config: NodeConfig, worker: EngineWorker, vocab_size: int):
        self.config, self.worker, self.vocab_size = config, worker, vocab_size
        self.active: dict[str, Active] = {}
        self.draining = False
        self.sender = None  # prefill role: a KVSender
        self.receiver = None  # decode role: a KVReceiver
        self.held: dict[str, int] = {}  # prefill: request id -> seq id whose blocks the sender holds
        self.tokenizer_json: bytes | None = None  # the model's, for structured output (set by the loader)
        self.eos_token_ids: tuple[int, ...] = ()
        self._grammars = None  # the model's compute.engine.grammar.Grammars, built on first use
        self._grammars_lock = threading.Lock()  # compiles run in worker threads: one at a time
        self.cache_feed = CacheFeed(worker)  # the prefix cache's changes, for POST /internal/cache
        self.pull_fallbacks = 0  # peer pulls that failed: the prompt computed instead (compute/node/peer.py)
        self.adapters = None  # the LoRA adapters this model serves (compute/node/adapters.py; set by held.build)
        self._pinned: dict = {}  # seq id -> the AdapterRef it runs (released when its request ends here)
        start_series(config.model)

    async def prepare(self, seq: Sequence) -> None:
        """What ``seq`` needs besides its KV, before it is queued: its adapter's weights (``adapters``: fetched on a
        miss, pinned until the request ends here) and, with a grammar, its matcher past its output so far, compiled
        in a worker thread (never on the event loop: the other streams go on meanwhile). BadNodeRequest if either
        cannot be had, NodeBusy if no adapter can be kept now."""
        ref = seq.params.adapter
        if ref is not None:
            if self.adapters is None:
                raise BadNodeRequest("this node serves no adapters")
            seq.lora = await self.adapters.acquire(ref)
            self._pinned[seq.seq_id] = ref
        try:
            await self._constrain(seq)
        except BaseException:
            self.unpin(seq.seq_id)
            raise

    def unpin(self, seq_id: int) -> None:
        """The request of ``seq_id`` no longer runs here: its adapter may be evicted."""
        ref = self._pinned.pop(seq_id, None)
        if ref is not None:
            self.adapters.release(ref)

    async def _constrain(self, seq: Sequence) -> None:
        spec = seq.params.grammar
        if spec is None:
            return
        if self.tokenizer_json is None:
            raise BadNodeRequest("structured output needs the model's tokenizer, which this node does not have")
        from compute.engine.grammar import InvalidGrammar

        try:
            seq.matcher = await asyncio.to_thread(self._matcher, spec, seq.token_ids[seq.prompt_len :])
        except InvalidGrammar as e:
            raise BadNodeRequest(f"response_format: {e}") from None

    def _matcher(self, spec: dict, output: list[int]):
        with self._grammars_lock:
            if self._grammars is None:
                from compute.engine.grammar import Grammars

                self._grammars = Grammars(self.tokenizer_json, self.vocab_size, self.eos_token_ids)
            return self._grammars.matcher(spec, output)

    @property
    def engine(self):
        """The engine; read its properties from here, call its verbs on its thread (``worker.call``/``post``)."""
        return self.worker.engine

    def check_accepting(self) -> None:
        if self.draining:
            raise NodeBusy(f"model {self.config.model!r} is draining on this node")

    def check_tokens(self, prompt: list[int]) -> None:
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise BadNodeRequest(f"token id out of range [0, {self.vocab_size})")

    async def add(self, rid: str, seq: Sequence, kind: str, pull=None) -> asyncio.Queue:
        """Register and queue a sequence on the engine thread; returns its output queue. ``pull``: how a peer's
        prefix of the prompt is pulled first, ``await pull(self, rid, seq)`` (compute/node/peer.py ``puller``; a
        failed pull is computed instead)."""
        if rid in self.active:
            self.unpin(seq.seq_id)
            raise BadNodeRequest(f"duplicate request_id {rid!r}")
        allowed = seq.params.allowed_token_ids
        if allowed is not None and max(allowed) >= self.vocab_size:
            self.unpin(seq.seq_id)
            raise BadNodeRequest(f"allowed_token_ids: token id {max(allowed)} out of range [0, {self.vocab_size})")
        q = self.worker.open_stream(seq.seq_id)
        self.active[rid] = Active(seq.seq_id, time.monotonic(), kind)
        try:
            if pull is not None:
                await pull(self, rid, seq)
            else:
                await self.worker.call(lambda e: e.add(seq))
        except NodeBusy:
            self.finish(rid)
            raise
        except RequestTooLarge as e:
            self.finish(rid)
            raise BadNodeRequest(str(e)) from None
        return q

    def finish(self, rid: str) -> None:
        a = self.active.pop(rid, None)
        if a is not None:
            self.worker.close_stream(a.seq_id)
            self.unpin(a.seq_id)

    def abort(self, rid: str) -> bool:
        a = self.active.get(rid)
        if a is not None:
            self.worker.post(lambda e, sid=a.seq_id: e.abort(sid))
            self.finish(rid)
        held = self.sender is not None and rid in self.held
        if held:
            self.sender.abort(rid)  # a finished prefill whose KV is still offered: free it now
        return a is not None or held

    async def relay(self, rid: str, q: asyncio.Queue) -> AsyncIterator[bytes]:
        """NDJSON lines of one sequence's outputs until it finishes; aborts it if the client leaves."""
        a = self.active[rid]
        model = self.config.model
        last = None
        n = 0
        done = False
        try:
            while True:
                o = await q.get()
                now = time.monotonic()
                if n == 0 and o.new_token_ids:
                    TTFT.labels(model).observe(now - a.started)
                elif last is not None and o.new_token_ids:
                    TPOT.labels(model).observe(now - last)
                last, n = now, n + len(o.new_token_ids)
                yield encode_line(output_line(o))
                if o.finished:
                    done = True
                    REQUEST_SECONDS.labels(model).observe(now - a.started)
                    FINISHED.labels(model, o.finish_reason or "stop").inc()
                    return
        finally:
            if not done:
                FINISHED.labels(model, "abort").inc()  # the client went away (or the node stops)
                self.abort(rid)
            self.finish(rid)

    def load(self) -> P.EngineLoad:
        """This model's queue and KV use, for its /load entry."""
        return P.EngineLoad(**self.engine.stats(), active_requests=len(self.active),
                            kv_transfers_held=self.sender.held() if self.sender is not None else 0,
                            peer_pull_fallbacks=self.pull_fallbacks)  # fmt: skip

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking requests; wait (bounded) until the ones in flight are done."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.active
