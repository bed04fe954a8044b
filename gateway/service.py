"""The gateway's state: model text bundle, node registry, admission, relay. One per process.

Lifecycle of a request (see ``relay`` for the node side): validate -> render chat
template / tokenize -> check context -> admit (or 429) -> relay token ids from the
nodes -> detokenize incrementally, apply stop strings -> stream to the client.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from compute.tokenizer import TextBundle

from .admission import Admission
from .config import GatewayConfig
from .nodes import NodeClient
from .registry import NodeRegistry
from .relay import GenRequest, Relay
from .stops import StopMatcher

log = logging.getLogger("pdserve.gateway")
REQUESTS = Counter("pdserve_gateway_requests_total", "Requests by final HTTP status", ["status"])
REQUEST_SECONDS = Histogram("pdserve_gateway_request_seconds", "Whole-request latency",
                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))  # fmt: skip
TTFT = Histogram("pdserve_gateway_ttft_seconds", "Time to first token at the gateway",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))  # fmt: skip


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


class Gateway:
    def __init__(self, config: GatewayConfig, bundle: TextBundle, max_model_len: int):
        self.config = config
        self.bundle = bundle
        self.max_model_len = config.max_model_len or max_model_len
        self.vocab_size = bundle.tokenizer.get_vocab_size(with_added_tokens=True)  # token ids are 0 .. vocab_size - 1
        headers = {"Authorization": f"Bearer {config.internal_token}"} if config.internal_token else {}
        self.registry = NodeRegistry(headers, config.health_interval_s, config.health_failures)
        for role, url in config.nodes:
            self.registry.add(url, role)
        self.client = NodeClient(headers, config.node_timeout_s)
        self.admission = Admission(config.max_running, config.max_queue, config.queue_timeout_s)
        self.relay = Relay(self.registry, self.client, config.retry_attempts, config.backoff_base_s,
                           config.backoff_max_s)  # fmt: skip
        self.autoscaler_status: dict = {}
        self.supervisor = None  # () -> dict: the local actuator's status() (`pdserve up`: restarts, crash loops)
        self.sources: list = []  # registry sources beyond static nodes, started with the gateway (gateway.discovery)

    async def start(self) -> None:
        await self.registry.start()
        for source in self.sources:
            await source.start()

    async def stop(self) -> None:
        for source in self.sources:
            await source.stop()
        await self.registry.stop()
        await self.client.close()

    # --- request preparation --------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.bundle.encode(self.bundle.render_chat(messages))

    def check_len(self, prompt: list[int], max_tokens: int | None, default: int | None = None) -> int:
        """-> max_tokens to use (unset: `default`, else up to the context; never beyond max_tokens_limit);
        BadRequest when the prompt (plus max_tokens) exceeds the context."""
        if not prompt:
            raise BadRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise BadRequest("prompt token id out of the vocabulary", "prompt")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {len(prompt)} tokens", "messages")  # fmt: skip
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {len(prompt)} and max_tokens asks for {max_tokens}", "max_tokens")  # fmt: skip
        limit = self.config.max_tokens_limit
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise BadRequest(f"max_tokens is {max_tokens}; this gateway generates at most {limit} tokens "
                             "per request", "max_tokens")  # fmt: skip
        return min(max_tokens or default or room, limit or room, room)

    @property
    def max_tokens_maximum(self) -> int:
        """The largest max_tokens any request may ask for (the OpenAPI document states it)."""
        return min(self.config.max_tokens_limit or self.max_model_len, self.max_model_len)

    def node_params(self, req) -> dict:
        seed = None if req.seed is None else req.seed % 2**63
        return {"temperature": req.temperature, "top_p": req.top_p, "top_k": max(0, req.top_k),
                "seed": seed, "ignore_eos": req.ignore_eos}  # fmt: skip

    # --- generation ------------------------------------------------------------------
    async def generate(self, prompt: list[int], max_tokens: int, params: dict, stops: list[str],
                       timing: dict) -> AsyncIterator[Delta]:  # fmt: skip
        """Admitted, relayed, detokenized deltas; the last one carries finish_reason."""
        t0 = time.monotonic()
        async with self.admission.slot():
            # one bound on the whole wait before the start: admission, then a node to exist (else 503)
            req = GenRequest(uuid.uuid4().hex, list(prompt), max_tokens, params,
                             deadline=t0 + self.config.queue_timeout_s)  # fmt: skip
            detok = self.bundle.detokenizer(prompt)
            matcher = StopMatcher(stops)
            first = True
            async with aclosing(self.relay.run(req)) as stream:
                async for toks, reason in stream:
                    if first:
                        timing["ttft"] = time.monotonic() - t0
                        TTFT.observe(timing["ttft"])
                        first = False
                    text, stopped = matcher.feed(detok.add([t for t in toks if t not in self.bundle.eos_token_ids]))
                    if stopped:
                        yield Delta(text, toks, "stop")
                        return
                    if reason:
                        tail, hit = matcher.feed(detok.flush())
                        tail = tail if hit else tail + matcher.flush()
                        yield Delta(text + tail, toks, "stop" if reason in ("stop", "eos") else reason)
                        return
                    yield Delta(text, toks, None)
