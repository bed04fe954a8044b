"""The life of one request inside the gateway, with failover. No accepted request is lost.

 1. admitted (``Admission.slot``), tokenized by the API layer;
 2. routed: ``router.pick`` over the nodes holding the request's model ready, minus those this
    request failed on, each scored by its load and the prompt's prefix its cache holds
    (``prefix_index``: the nodes' cache reports, and what this gateway sent where); with none, the
    request is held by the ``Activator`` until its deadline (then ``NotPlaced``: 503 with
    Retry-After). The choices of one ``n > 1`` request share an ``Affinity``: their first attempts
    take one route, so the node computes their prompt once
    (``fork_group``, compute/engine/scheduler.py); a retry routes on its own;
 3. split route: POST /internal/prefill -> first token + KV handle; POST /internal/decode
    with the handle streams the rest. ``both`` route: POST /internal/generate. Every body
    names the model (``"model"``): a node of several models serves that one. A route that pulls
    (``Route.pull_from``: another node holds more of the prompt cached, and pulling it is cheaper than
    computing it) first asks that node for an export (POST /internal/kv/export) and passes its handle
    in the prefill or generate body (``pull``): the node pulls the blocks it lacks (compute/node/peer.py);
    an export refused, or a pull that fails, only means the prefix is computed;
 4. a node failing (connection error, timeout, 5xx, stream cut) -> exponential backoff with
    full jitter, then back to 2 with prompt := prompt + tokens already streamed and
    max_tokens reduced: the client's stream continues without repeating or skipping tokens;
 5. only when ``retry_attempts`` retries all fail does the caller get ``Unavailable``;
 6. whatever the exit (finish, client gone, error), the nodes still holding the request
    get an abort, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from prometheus_client import Counter

from compute.engine.sampling import SamplingParams
from compute.node.protocol import DecodeRequest, ExportRequest, GenerateRequest, StreamLine
from gateway.routing.activator import Activator
from gateway.routing.nodes import NodeClient, NodeFailed, RequestRejected
from gateway.routing.registry import NodeRegistry
from gateway.routing.router import Route, decode_key

log = logging.getLogger("pdserve.gateway")
RETRIES = Counter("pdserve_gateway_retries_total", "Node failures retried on another node", ["phase"])
PULLS = Counter("pdserve_gateway_routed_with_pull_total",
                "Requests sent with a peer's export of their cached prefix to pull (compute/node/peer.py)")
PULLS_REFUSED = Counter("pdserve_gateway_pull_exports_refused_total",
                        "Exports a holder could not give (evicted, busy, gone): the node computed the prefix")


class Unavailable(Exception):
    """No node could serve the request within its attempts/deadline (HTTP 503)."""


@dataclass(slots=True)
class GenRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)  # max_tokens set per attempt
    model: str = ""  # the served model name ("": any node, and no "model" in the node bodies)
    deadline: float = 0.0  # monotonic; for waiting on capacity
    produced: list[int] = field(default_factory=list)
    attempts: int = 0
    route: Route | None = None  # the route of the last attempt
    affinity: Affinity | None = None  # shared by the choices of one n > 1 request


class Affinity:
    """One route for several requests' first attempts: the first to route decides, the others wait for it."""

    def __init__(self) -> None:
        self.route: asyncio.Future | None = None


class Relay:
    def __init__(self, registry: NodeRegistry, client: NodeClient, retry_attempts: int,
                 backoff_base_s: float, backoff_max_s: float, activator: Activator | None = None):  # fmt: skip
        self.registry, self.client = registry, client
        self.retry_attempts, self.base, self.cap = retry_attempts, backoff_base_s, backoff_max_s
        self.activator = activator or Activator(registry)  # holds a request whose model no node holds
        self.export_timeout_s = 2.0  # a holder's export answers within this, or the node computes the prefix

    async def _route(self, req: GenRequest, exclude: set[str]) -> Route:
        aff = req.affinity

        def hold():  # scored by the prompt's cached prefix too (router.py), unless the node will take none of it
            sp = req.params  # (a request for prompt logprobs computes every prompt row: compute/engine/prefix_cache.py)
            prompt = req.prompt_ids if sp.prompt_logprobs is None else None
            return self.activator.hold(req.model or None, req.deadline, exclude, prompt, sp.hash_salt,
                                         sp.adapter.ref if sp.adapter is not None else None)

        if aff is None or req.attempts or exclude:
            return await hold()
        if aff.route is None:
            aff.route = asyncio.ensure_future(hold())
            aff.route.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even if no one waits
        return await asyncio.shield(aff.route)  # one member gone does not cancel the others' route

    def _body(self, req: GenRequest, node_rid: str) -> GenerateRequest:
        n = len(req.produced)  # earlier output, now part of the prompt: replayed, and counted as output
        params = msgspec.structs.replace(req.params, max_tokens=req.max_tokens - n,
                                         prompt_logprobs=None if n else req.params.prompt_logprobs)  # a retry has them
        return GenerateRequest(node_rid, req.prompt_ids + req.produced, params, req.model or None,
                               replay_tokens=n, output_tokens=n)  # fmt: skip

    async def run(self, req: GenRequest) -> AsyncIterator[StreamLine]:
        """Yields the nodes' ``StreamLine``s as they came (new token ids, finish_reason or None, logprobs) until a
        finish reason."""
        exclude: set[str] = set()
        while True:
            route = await self._route(req, exclude)
            req.route = route
            node_rid = f"{req.request_id}.{req.attempts}"
            holding: list[str] = []
            finished = False
            try:
                async with aclosing(self._attempt(req, route, node_rid, holding)) as chunks:  # closed with us
                    async for chunk in chunks:
                        req.produced.extend(chunk.token_ids)
                        if chunk.finish_reason:
                            finished = True
                        yield chunk
                        if chunk.finish_reason:
                            return
                raise NodeFailed(route.nodes()[-1], "stream ended early")
            except NodeFailed as e:
                exclude.add(e.url)
                self.registry.suspect(e.url)
                req.attempts += 1
                RETRIES.labels("decode" if req.produced else "prefill").inc()
                log.warning("request %s: %s; attempt %d/%d", req.request_id, e, req.attempts, self.retry_attempts)
                if req.attempts > self.retry_attempts:
                    raise Unavailable(f"request failed after {req.attempts} attempts: {e}") from None
                await asyncio.sleep(random.uniform(0, min(self.cap, self.base * 2 ** (req.attempts - 1))))
            finally:
                if not finished:
                    for url in holding:
                        await _shielded(self.client.abort(url, node_rid))

    async def _export(self, req: GenRequest, route: Route) -> dict | None:
        """The holder's export of the prompt's cached prefix for the route's node to pull, or None (nothing to
        pull, or the holder could not: the node computes the prefix, as without a pull)."""
        if route.pull_from is None or req.produced or req.params.fork_group or req.params.prompt_logprobs is not None:
            return None
        msg = ExportRequest(prompt_token_ids=req.prompt_ids, cache_salt=req.params.hash_salt, model=req.model or None)
        try:
            reply = await self.client.export(route.pull_from, msg, self.export_timeout_s)
        except (NodeFailed, RequestRejected) as e:
            PULLS_REFUSED.inc()
            log.info("request %s: no export from %s (%s): its node computes the prefix", req.request_id,
                     route.pull_from, e)  # fmt: skip
            return None
        PULLS.inc()
        return reply.kv.reachable_from(route.pull_from)

    async def _attempt(self, req: GenRequest, route: Route, rid: str, holding: list[str]):
        body, model, sending = self._body(req, rid), req.model or None, self.registry.sending
        tokens = len(body.prompt_token_ids)
        if not route.split:
            holding.append(route.both)
            body.pull = await self._export(req, route)
            with sending(route.both, model, tokens, streams=1) as sent:
                async for msg in self.client.generate(route.both, body):
                    sent.prefilled()
                    yield _unpack(route.both, msg)
            return
        holding.append(route.prefill)
        body.pull = await self._export(req, route)
        with sending(route.prefill, model, tokens):
            first = await self.client.prefill(route.prefill, body)
        chunk = _unpack(route.prefill, first)
        toks = chunk.token_ids
        if chunk.finish_reason or not first.kv:
            holding.clear()
            yield StreamLine(chunk.token_ids, chunk.finish_reason or "stop", chunk.logprobs, chunk.prompt_logprobs,
                             chunk.error, chunk.cached_tokens)  # fmt: skip
            return
        yield chunk
        route = req.route = self._decode_still_live(route, model)
        holding.append(route.decode)
        params = msgspec.structs.replace(body.params, max_tokens=body.params.max_tokens - len(toks), prompt_logprobs=None)
        dbody = DecodeRequest(body.request_id, body.prompt_token_ids, params, body.model,
                              output_tokens=body.output_tokens, first_token_id=toks[-1],
                              kv=first.kv.reachable_from(route.prefill))  # fmt: skip
        with sending(route.decode, model, streams=1):
            async for msg in self.client.decode(route.decode, dbody):
                holding[:] = [route.decode]  # the decode side confirmed the KV: prefill has freed it
                yield _unpack(route.decode, msg)

    def _decode_still_live(self, route: Route, model: str | None = None) -> Route:
        """The decode node picked before the prefill may have started draining (scale-down) since:
        hand the KV to another ready decode node of the model instead (any can claim the handle)."""
        views = self.registry.views(model)
        if any(v.url == route.decode and v.routable for v in views):
            return route
        live = [v for v in views if v.role == "decode" and v.routable]
        if not live:
            return route  # nowhere better: try it; a refusal is retried like any node failure
        decode = min(live, key=decode_key).url
        log.info("decode node %s left during prefill: handing the KV to %s", route.decode, decode)
        return Route(prefill=route.prefill, decode=decode)


def _unpack(url: str, msg: StreamLine) -> StreamLine:
    reason = msg.finish_reason
    if reason in ("error", "abort"):  # the gateway never asked for it: the node failed or is leaving
        raise NodeFailed(url, msg.error or f"request ended by the node ({reason})")
    return msg


async def _shielded(coro) -> None:
    try:
        await asyncio.shield(coro)
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - best effort on the way out
        pass
