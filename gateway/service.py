"""The gateway's state: the served models (``models``), node registry, activator, admission,
relay, per-model traffic. One per process.

Lifecycle of a request (see ``relay`` for the node side): validate -> the model's text (404 if
not served; its bundle read from the store on first use) -> render chat template / tokenize ->
check the model's context -> no node holds the model: held by the activator (503 with
Retry-After past the deadline) -> admit (or 429) -> relay token ids from the nodes of that model
-> detokenize incrementally, apply stop strings -> stream to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from compute.engine.sampling import AdapterRef, SamplingParams
from gateway.admission.control import Admission
from gateway.admission.traffic import Traffic
from gateway.api import tools
from gateway.api.formats import grammar_spec
from gateway.api.stops import StopMatcher
from gateway.config import GatewayConfig
from gateway.models import ModelCatalogue, Text
from gateway.routing.activator import Activator
from gateway.routing.nodes import NodeClient
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.registry import NodeRegistry
from gateway.routing.relay import Affinity, GenRequest, Relay
from gateway.routing.router import PullCost

log = logging.getLogger("pdserve.gateway")
PRELOAD_MAX = 16  # at start, the texts of this many served models are read in the background
REQUESTS = Counter("pdserve_gateway_requests_total", "Requests by final HTTP status", ["status"])
REQUEST_SECONDS = Histogram("pdserve_gateway_request_seconds", "Whole-request latency",
                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))  # fmt: skip
TTFT = Histogram("pdserve_gateway_ttft_seconds", "Time to first token at the gateway",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))  # fmt: skip
ROUTED = Counter("pdserve_gateway_routed_total", "Requests by what chose their node: hit (its cached prefix) or load",
                 ["by"])  # fmt: skip
HIT_TOKENS = Histogram("pdserve_gateway_prefix_hit_tokens",
                       "Prompt tokens the chosen node's cache was expected to give",
                       buckets=(0, 16, 64, 256, 512, 1024, 2048, 4096, 8192))  # fmt: skip
for _by in ("hit", "load"):
    ROUTED.labels(_by)


_SAMPLING_FIELDS = SamplingParams.__struct_fields__
# sampling fields the API spells or bounds otherwise (or the relay sets): translated in node_params
_TRANSLATED = {"max_tokens", "top_k", "seed", "logit_bias", "stop_token_ids", "logprobs", "prompt_logprobs",
               "grammar", "fork_group", "cache_salt", "adapter"}  # fmt: skip

class BadRequest(ValueError):
    """The request is invalid (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None  # per token [logprob, [[id, logprob], ...]] as the node sent them
    prompt_logprobs: list | None = None  # with the first delta, if asked: null, then one per prompt token
    cached_tokens: int | None = None  # with the first delta: prompt tokens the node's prefix cache gave (usage)

    @classmethod
    def of(cls, text: str, line, finish_reason: str | None) -> Delta:
        """The delta of one node line (``StreamLine``): its tokens as ``text``, its numbers as they came."""
        return cls(text, line.token_ids, finish_reason, line.logprobs, line.prompt_logprobs, line.cached_tokens)


class Gateway:
    def __init__(self, config: GatewayConfig, models: ModelCatalogue):
        self.config = config
        self.models = models
        index = PrefixIndex(config.prefix_ttl_s) if config.routing == "cache" else None
        self.registry = NodeRegistry(config.internal_token, config.health_interval_s, config.health_failures, index)
        for role, url in config.nodes:
            self.registry.add(url, role)
        self.client = NodeClient(config.internal_token, config.node_timeout_s)
        self.admission = Admission(config.max_running, config.max_queue, config.queue_timeout_s)
        pull = PullCost(config.pull_fixed_s, config.pull_bytes_per_s, config.prefill_tokens_per_s)
        self.activator = Activator(self.registry, pull=pull if config.peer_pull and index is not None else None)
        self.relay = Relay(self.registry, self.client, config.retry_attempts, config.backoff_base_s,
                           config.backoff_max_s, self.activator)  # fmt: skip
        self.relay.export_timeout_s = config.pull_export_timeout_s
        self.traffic = Traffic()
        self.autoscaler_status: dict = {}
        self.supervisor = None  # () -> dict: the local actuator's status() (`pdserve up`: restarts, crash loops)
        self.sources: list = []  # registry sources beyond static nodes, started with the gateway (gateway.routing.discovery)
        self._refresher: asyncio.Task | None = None
        self.prepuller = None  # a node joining pulls the hottest prefixes (gateway/routing/prepull.py)
        if index is not None and config.peer_pull and config.prepull_chains:
            from gateway.routing.prepull import Prepuller

            self.prepuller = Prepuller(self.registry, index, self.client, config.prepull_chains)
        self._prepulling: asyncio.Task | None = None

    @property
    def activate(self):
        """`activate(model)`: ask for `model` to be placed (the activator calls it while it holds requests)."""
        return self.activator.activate

    @activate.setter
    def activate(self, fn) -> None:
        self.activator.activate = fn

    async def start(self) -> None:
        await self.registry.start()
        for source in self.sources:
            await source.start()
        self._refresher = asyncio.create_task(self._refresh_models())
        if self.prepuller is not None:
            self._prepulling = asyncio.create_task(self.prepuller.run())

    async def stop(self) -> None:
        for task in (self._refresher, self._prepulling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for source in self.sources:
            await source.stop()
        await self.registry.stop()
        await self.client.close()
        await asyncio.to_thread(self.models.close)

    async def _refresh_models(self) -> None:
        """Read the served models' texts in the background now (a first request finds its model's
        ready, or waits on that same read), then list the store again every refresh_s."""
        for name in self.models.names[:PRELOAD_MAX]:
            try:
                await self.models.text(name)
            except Exception as e:  # noqa: BLE001 - its first request reports it (404 / 503)
                log.warning("model %s: text bundle not read: %s", name, e)
        while True:  # ends with stop()
            await asyncio.sleep(self.models.refresh_s)
            await self.models.refresh()

    def ready(self) -> bool:
        """/ready: some served model is routable, or an activator is set and some node is registered."""
        if self.activator.activate is not None and self.registry.nodes:
            return True
        return any(self.activator.route(m) is not None for m in self.registry.routable_models())

    # --- request preparation --------------------------------------------------------
    async def text(self, model: str) -> Text:
        """The model's text side (UnknownModel: not served)."""
        return await self.models.text(model)

    async def chat_prompt(self, text: Text, messages: list[dict], offered: list[dict] | None = None) -> list[int]:
        """Messages (and the tools ``offered``) through the model's chat template, tokenized, in a worker thread:
        templating and tokenizing a long prompt never stalls the streams on the event loop."""
        return await asyncio.to_thread(lambda: text.bundle.encode(text.bundle.render_chat(messages, tools=offered)))

    def check_len(self, text: Text, prompt: list[int], max_tokens: int | None, default: int | None = None) -> int:
        """-> max_tokens to use (unset: `default`, else up to the context; never beyond max_tokens_limit);
        BadRequest when the prompt (plus max_tokens) exceeds the model's context."""
        if not prompt:
            raise BadRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < text.vocab_size for t in prompt):
            raise BadRequest("prompt token id out of the vocabulary", "prompt")
        ctx = text.max_model_len
        room = ctx - len(prompt)
        if room < 1:
            raise BadRequest(f"this model's maximum context length is {ctx} tokens; "
                             f"the prompt has {len(prompt)} tokens", "messages")  # fmt: skip
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(f"this model's maximum context length is {ctx} tokens; the prompt "
                             f"has {len(prompt)} and max_tokens asks for {max_tokens}", "max_tokens")  # fmt: skip
        limit = self.config.max_tokens_limit
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise BadRequest(f"max_tokens is {max_tokens}; this gateway generates at most {limit} tokens "
                             "per request", "max_tokens")  # fmt: skip
        return min(max_tokens or default or room, limit or room, room)

    def document_limits(self) -> tuple[int, int, bool]:
        """(largest max_tokens, vocabulary size, whether any takes tools) over the served models, for the
        OpenAPI document (each model's text read now if not yet: once, when the document is first asked for)."""
        texts = []
        for name in self.models.names:
            try:
                texts.append(self.models.text_sync(name))
            except Exception as e:  # noqa: BLE001 - a model that cannot be read is left out of the limits
                log.warning("model %s: text bundle not readable for the OpenAPI document: %s", name, e)
        ctx = max((t.max_model_len for t in texts), default=self.config.max_model_len or 2048)
        vocab = max((t.vocab_size for t in texts), default=1)
        takes_tools = any(tools.supported(t.bundle) for t in texts) or not texts  # none read: left open
        return min(self.config.max_tokens_limit or ctx, ctx), vocab, takes_tools

    def node_params(self, req, extra: dict | None = None, grammar: dict | None = None,
                    cache_salt: str | None = None, adapter: AdapterRef | None = None) -> SamplingParams:  # fmt: skip
        """The engine's parameters of an API request, made (and checked) once: every field of the request named
        as one of ``SamplingParams`` is taken as it is (a field added to both needs nothing here); the rest are
        translated below. ``extra``: one choice's own (seed, fork_group); ``grammar``: the tools' (over the
        response format's); ``cache_salt``: the tenant's salted one; ``adapter``: the LoRA adapter the request's model
        names. max_tokens is set per attempt by the relay."""
        same = {f: getattr(req, f) for f in _SAMPLING_FIELDS if f not in _TRANSLATED and getattr(req, f, None) is not None}
        seed = None if req.seed is None else req.seed % 2**63
        kw = dict(same, top_k=max(0, req.top_k), seed=seed, logit_bias=req.logit_bias or {},
                  stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=req.num_logprobs(),
                  prompt_logprobs=req.num_logprobs() if getattr(req, "echo", False) else None,
                  grammar=grammar if grammar is not None else grammar_spec(req.response_format), cache_salt=cache_salt,
                  adapter=adapter)
        return SamplingParams(**(kw | (extra or {})))

    # --- generation ------------------------------------------------------------------
    async def generate(self, text: Text, prompt: list[int], max_tokens: int, params: SamplingParams, stops: list[str],
                       timing: dict, affinity: Affinity | None = None) -> AsyncIterator[Delta]:  # fmt: skip
        """Held (no node holds the model yet), admitted, relayed, detokenized deltas; the last one
        carries finish_reason. One bound on the whole wait before the start (queue_timeout_s):
        the hold, admission, then a node to exist — past it NotPlaced / Overloaded / Unavailable."""
        t0 = time.monotonic()
        model, traffic = text.routed, self.traffic  # an adapter's requests are its base's demand
        deadline = t0 + self.config.queue_timeout_s
        traffic.arrived(model, len(prompt), max_tokens)
        if self.activator.route(model) is None:  # held outside admission: a cold model takes no slot
            await self.activator.hold(model, deadline)
        traffic.admitting(model, 1)
        admitted = False
        try:
            async with self.admission.slot() as waited:
                traffic.admitting(model, -1)
                admitted = True
                traffic.admitted(model, waited)
                req = GenRequest(uuid.uuid4().hex, list(prompt), max_tokens, params, model=model, deadline=deadline,
                                 affinity=affinity)  # fmt: skip
                marks: dict = {"first": None, "n": 0}
                try:
                    async with aclosing(self._relayed(text, req, stops, t0, timing, marks)) as deltas:
                        async for d in deltas:
                            yield d
                finally:
                    traffic.finished(model, marks["n"], marks["first"], time.monotonic())
        finally:
            if not admitted:
                traffic.admitting(model, -1)

    async def _relayed(self, text: Text, req: GenRequest, stops: list[str], t0: float, timing: dict,
                       marks: dict) -> AsyncIterator[Delta]:  # fmt: skip
        detok = text.bundle.detokenizer(req.prompt_ids)
        eos = text.bundle.eos_token_ids
        matcher = StopMatcher(stops)
        async with aclosing(self.relay.run(req)) as stream:
            async for line in stream:  # the nodes' StreamLine (compute/node/protocol.py), as they sent it
                toks, reason = line.token_ids, line.finish_reason
                marks["n"] += len(toks)
                if marks["first"] is None:
                    hit = req.route.hit_tokens if req.route is not None else 0
                    ROUTED.labels("hit" if hit else "load").inc()  # the route that gave the first token
                    HIT_TOKENS.observe(hit)
                    marks["first"] = time.monotonic()
                    timing["ttft"] = marks["first"] - t0
                    TTFT.observe(timing["ttft"])
                    self.traffic.first_token(req.model, timing["ttft"])
                out, stopped = matcher.feed(detok.add([t for t in toks if t not in eos]))
                if stopped:
                    yield Delta.of(out, line, "stop")
                    return
                if reason:
                    tail, hit = matcher.feed(detok.flush())
                    tail = tail if hit else tail + matcher.flush()
                    yield Delta.of(out + tail, line, "stop" if reason in ("stop", "eos") else reason)
                    return
                yield Delta.of(out, line, None)
