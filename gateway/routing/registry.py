"""The node registry: which nodes exist, their role, health and load.

Fed by static config, by the local launcher / autoscaler (``add``/``remove``,
also over the admin API) or by Kubernetes endpoints. A node added is first challenged: it must
prove it holds the internal token and is the node at its URL (``/prove``, compute/node/auth.py)
before anything else is sent to it; one that answers with a wrong proof (or no proof route) is
refused — dropped, named in ``refused`` with why, never polled again (an unreachable one is asked
again at the next poll). Every request after that is signed, never carrying the token. A health loop polls each
proven node's ``/load``: ``health_failures`` consecutive failures evict a node from
routing (it stays known and is re-admitted when it answers again). Any failed poll or failed request
(``suspect``) un-proves the node: nothing is routed to it until it answers a new challenge, so whatever
answers on a dead node's address later (another process on its port, another pod given its IP) gets no
prompt and no signed request without proving itself; a node still
loading weights reports ready=false and is not routed to.

A node may hold several models (its /load, ``protocol.LoadReport``, has ``models``: NAME -> ``ModelLoad``):
``views(model)`` sees each node as it serves that one model — routable only where that model is
"ready", with that model's queue, streams and free KV blocks.

The registry also keeps the prefix index (``index``, gateway/routing/prefix_index.py; None when the
gateway routes by load only): each poll of a routable node also asks, in the background (one ask per node
in flight), for its prefix cache's changes (POST /internal/cache, from the cursor of its last report), and a node removed, marked draining,
reporting draining, or evicted by failed health checks leaves the index.

Between two polls the gateway corrects each node's last /load by what it itself did since that poll was
sent (``sent``): requests it sent there count at once, and requests that finished there stop counting at
once (their prompt tokens when the first token comes back, their stream when it ends). So a node that just
finished a request is not weighed as busy for up to a poll interval, and a burst does not all go to the node
that looked emptiest at the last poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field

import httpx

from compute.node import auth
from compute.node import protocol as P
from compute.node.client import AsyncNodeClient
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.router import NodeView

log = logging.getLogger("pdserve.gateway")

# A node's URL, exactly (the admin API's schema states this pattern; nothing it admits is refused):
# http or https; a DNS name whose last label starts with a letter (labels of 1-63 letters, digits, hyphens),
# an IPv4 address or a bracketed IPv6 one; a port 1-65535; a path of unreserved characters; no user, query
# or fragment. ASCII only: an internationalised host name goes in its IDNA (xn--) form.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = rf"(?:{_LABEL}\.)*[A-Za-z](?:[A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_H = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join((rf"(?:{_H}:){{7}}{_H}", rf"(?:{_H}:){{1,7}}:", rf"(?:{_H}:){{1,6}}:{_H}",
                  *(rf"(?:{_H}:){{1,{6 - i}}}(?::{_H}){{1,{i + 1}}}" for i in range(1, 6)),
                  rf":(?:(?::{_H}){{1,7}}|:)"))  # fmt: skip
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
NODE_URL = rf"^https?://(?:{_NAME}|{_OCTET}(?:\.{_OCTET}){{3}}|\[(?:{_IPV6})\])(?::{_PORT})?(?:/[A-Za-z0-9._~-]*)*$"
NODE_URL_MAX = 2048  # characters
_NODE_URL = re.compile(NODE_URL.replace("$", r"\Z"))  # Python's $ also matches before a final newline


NODE_ROLES = ("prefill", "decode", "both")


def node_url(url: str) -> str:
    """`url` as the registry keys it (no trailing slash); ValueError saying what is wrong with it."""
    if not isinstance(url, str) or len(url) > NODE_URL_MAX or not _NODE_URL.match(url):
        shown = url[:80] + "..." if isinstance(url, str) and len(url) > 80 else url
        raise ValueError(f"invalid node URL {shown!r}: want http(s)://HOST[:PORT][/PATH] with an ASCII host name "
                         "(IDNA form), an IPv4 or a bracketed IPv6 address, a port 1-65535, no user, query or fragment")
    return url.rstrip("/")


@dataclass(slots=True)
class NodeState:
    url: str
    role: str
    healthy: bool = False  # answered its last health checks
    failures: int = 0
    load: P.LoadReport = field(default_factory=P.LoadReport)  # last /load
    seen: float = 0.0  # monotonic time of the last answer
    source: str = "static"
    draining: bool = False  # told by the actuator before it drains the node: stop routing at once
    proven: bool = False  # answered the challenge: holds the internal token and is the node at `url`
    proving: asyncio.Future | None = field(default=None, repr=False)  # the challenge in flight (one per node)
    sent: dict = field(default_factory=dict)  # model -> [prompt tokens, streams] this gateway has open there now
    polled: dict = field(default_factory=dict)  # the same, as it was when the last /load was asked for

    def _since_poll(self, model: str | None) -> tuple[int, int]:
        """(prompt tokens, streams) this gateway opened there minus what closed, since the last /load was asked."""
        keys = self.sent.keys() | self.polled.keys() if model is None else (model,)  # a request's model: its key
        now = [sum(self.sent.get(k, (0, 0))[i] for k in keys) for i in (0, 1)]
        then = [sum(self.polled.get(k, (0, 0))[i] for k in keys) for i in (0, 1)]
        return now[0] - then[0], now[1] - then[1]

    def view(self, model: str | None = None) -> NodeView:
        """This node as the router sees it: as a whole (`model` None), or as it serves `model`."""
        ld = self.load
        tokens, streams = self._since_poll(model)
        if model is None:
            return NodeView(url=self.url, role=self.role, ready=self.proven and self.healthy and ld.ready,
                            draining=self.draining or ld.draining,
                            queued_prompt_tokens=max(0, ld.queued_prompt_tokens + tokens),
                            running=max(0, ld.running + streams), kv_blocks_free=ld.kv_blocks_free)  # fmt: skip
        m = ld.models.get(model)
        if m is None:
            return NodeView(url=self.url, role=self.role, ready=False, draining=self.draining or ld.draining)
        return NodeView(url=self.url, role=self.role, ready=self.proven and self.healthy and m.state == "ready",
                        draining=self.draining or ld.draining or m.state == "draining",
                        queued_prompt_tokens=max(0, m.queued_prompt_tokens + tokens),
                        running=max(0, m.running + streams), kv_blocks_free=m.kv_blocks_free,
                        kv_block_bytes=m.kv_bytes // m.kv_blocks_total if m.kv_blocks_total else 0,
                        prefill_tokens_per_s=float(m.capacity.get("prefill_tokens_per_s") or 0.0),
                        adapters=frozenset(m.lora.kept) if m.lora else frozenset(),
                        adapter_load_s=m.lora.load_seconds if m.lora else 0.0)  # fmt: skip

    def opened(self, model: str | None, tokens: int = 0, streams: int = 0) -> None:
        """This gateway sent (positive) or saw end (negative) `tokens` prompt tokens / `streams` streams here."""
        got = self.sent.setdefault(model or "", [0, 0])
        got[0] += tokens
        got[1] += streams

    def held_models(self) -> dict[str, str]:
        """model -> its state on this node (loading, ready, draining, failed)."""
        return {k: v.state for k, v in self.load.models.items()}

    def routable_models(self) -> set[str]:
        return {m for m in self.held_models() if self.view(m).routable}

    @property
    def state(self) -> str:
        """As the gateway sees it: unproven, unhealthy, draining, or the node's own state."""
        ld = self.load
        return ("unproven" if not self.proven else "unhealthy" if not self.healthy
                else "draining" if self.draining or ld.draining else ld.state)  # fmt: skip

    def entry(self) -> dict:
        """This node as a status lists it (gateway/api/status.py ``NodeEntry``'s fields; ``load`` as it is)."""
        return {"url": self.url, "role": self.role, "state": self.state, "models": self.held_models(),
                "load": self.load, "source": self.source}  # fmt: skip

    def as_dict(self) -> dict:
        """``entry`` as plain data (the admin API's)."""
        return {**self.entry(), "load": self.load.as_dict()}


class Sending:
    """One request's share of a node's corrected load (``NodeRegistry.sending``); a node unknown: nothing."""

    __slots__ = ("node", "model", "tokens", "streams")

    def __init__(self, node: NodeState | None, model: str | None, tokens: int, streams: int) -> None:
        self.node, self.model, self.tokens, self.streams = node, model, tokens, streams

    def __enter__(self) -> Sending:
        if self.node is not None:
            self.node.opened(self.model, self.tokens, self.streams)
        return self

    def prefilled(self) -> None:
        """The first token came back: the prompt left the node's queue."""
        if self.node is not None and self.tokens:
            self.node.opened(self.model, -self.tokens)
        self.tokens = 0

    def __exit__(self, *exc) -> None:
        if self.node is not None:
            self.node.opened(self.model, -self.tokens, -self.streams)
        self.tokens = self.streams = 0


REFUSED_MAX = 256  # refused URLs remembered (for status and logs), oldest forgotten first


class NodeRegistry:
    def __init__(self, token: str | None, interval_s: float = 0.5, failures: int = 2,
                 index: PrefixIndex | None = None):  # fmt: skip
        self.nodes: dict[str, NodeState] = {}
        self.refused: dict[str, str] = {}  # url -> why it failed the proof
        self.token = token
        self.interval_s = interval_s
        self.max_failures = failures
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set whenever a node (or a model on it) becomes routable
        self._polled = 0.0  # monotonic time of the last poll of every node
        self._poll_lock: asyncio.Lock | None = None
        self.index = index  # which node holds which prefix blocks (None: routing by load only)
        self._cache_asks: dict[str, asyncio.Task] = {}  # url -> its cache report in flight

    def add(self, url: str, role: str, source: str = "static") -> NodeState:
        """Register a node (challenged before anything is sent to it); ValueError for a URL or role that is not a
        node's, from whichever path it came (static, discovered, the admin API, the autoscaler)."""
        if role not in NODE_ROLES:
            raise ValueError(f"invalid node role {str(role)[:40]!r}: one of {', '.join(NODE_ROLES)}")
        url = node_url(url)
        if url not in self.nodes:
            self.refused.pop(url, None)  # registered again: challenged again
            self.nodes[url] = NodeState(url, role, source=source)
            log.info("node registered: %s (%s, %s)", url, role, source)
        return self.nodes[url]

    def remove(self, url: str) -> bool:
        self._forget(url.rstrip("/"))
        return self.nodes.pop(url.rstrip("/"), None) is not None

    def mark_draining(self, url: str) -> None:
        """The node is about to drain: no new request goes to it from now on (its streams go on)."""
        n = self.nodes.get(url.rstrip("/"))
        if n:
            n.draining = True
            self._forget(n.url)

    def _forget(self, url: str) -> None:
        if self.index is not None:
            self.index.forget(url)

    async def refresh(self, url: str) -> str | None:
        """Check one node now (a node just announced ready is routable without waiting a poll); why it
        was refused, if it failed the proof (it is no longer registered then)."""
        url = url.rstrip("/")
        n = self.nodes.get(url)
        if n is not None and self._client is not None:
            await self._check(n)
        return self.refused.get(url)

    def views(self, model: str | None = None) -> list[NodeView]:
        """Every node as it serves `model` (None: as a whole); with the block size its cache reported."""
        views = [n.view(model) for n in self.nodes.values()]
        if self.index is None or model is None:
            return views
        sizes = self.index.block_sizes(model)
        return [dataclasses.replace(v, block_size=sizes[v.url]) if v.url in sizes else v for v in views]

    def routable_models(self) -> set[str]:
        """The models some ready node holds ready now (a split route may still lack a role)."""
        return set().union(*(n.routable_models() for n in self.nodes.values()))

    def sending(self, url: str, model: str | None, tokens: int = 0, streams: int = 0) -> Sending:
        """Count a request sent to `url` until it ends (``with``): its `tokens` prompt tokens until
        ``prefilled()``, its `streams` until the end (see the module's note on ``sent``)."""
        return Sending(self.nodes.get(url), model, tokens, streams)

    def suspect(self, url: str) -> None:
        """A request failed on this node: stop routing to it until its next good health check, which challenges it
        again first (whatever answers there now may not be the node that proved itself)."""
        n = self.nodes.get(url)
        if n:
            n.healthy = n.proven = False

    async def start(self) -> None:
        self._client = AsyncNodeClient(self.token, timeout_s=2.0, max_connections=64)
        await self.poll_once()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for task in list(self._cache_asks.values()):
            task.cancel()
        if self._cache_asks:
            await asyncio.gather(*self._cache_asks.values(), return_exceptions=True)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client:
            await self._client.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad poll
                log.exception("health poll failed")

    async def poll_once(self) -> None:
        self._polled = time.monotonic()
        await asyncio.gather(*(self._check(n) for n in list(self.nodes.values())))

    async def poll_stale(self, max_age_s: float) -> None:
        """Poll every node now unless that was done in the last `max_age_s` (the activator, while it
        holds requests, calls this from many requests at once: one poll serves them all)."""
        if self._client is None:
            return
        if self._poll_lock is None:
            self._poll_lock = asyncio.Lock()
        async with self._poll_lock:
            if time.monotonic() - self._polled >= max_age_s:
                await self.poll_once()

    async def _prove(self, n: NodeState) -> str | None:
        """Challenge `n` (unsigned: nothing but a fresh nonce and its URL goes out); why it failed, or None.
        A transport error or a 5xx raises (unreachable or starting: asked again at the next poll)."""
        if not self.token:
            return "this gateway has no internal token to check a proof against (set $PDSERVE_INTERNAL_TOKEN)"
        nonce = auth.challenge()
        status, proof, text = await self._client.prove(n.url, nonce)
        if auth.check_proof(self.token, nonce, n.url, proof):
            return None
        if status != 200:
            detail = text[:200].strip()
            return f"it answered the challenge with {status}{': ' + detail if detail else ''}"
        return "its proof does not match: it does not hold this deployment's internal token, or is not the node at this URL"

    async def _proof(self, n: NodeState) -> str | None:
        """``_prove``, one challenge in flight per node: a registration's check and a poll share it."""
        if n.proving is None:
            n.proving = asyncio.ensure_future(self._prove(n))
            n.proving.add_done_callback(lambda _: setattr(n, "proving", None))
        return await asyncio.shield(n.proving)

    def _refuse(self, n: NodeState, why: str) -> None:
        self.nodes.pop(n.url, None)
        self._forget(n.url)
        self.refused[n.url] = why
        while len(self.refused) > REFUSED_MAX:
            self.refused.pop(next(iter(self.refused)))
        log.warning("node refused: %s (%s, %s): %s; it is not polled again", n.url, n.role, n.source, why)

    async def _check(self, n: NodeState) -> None:
        try:
            if not n.proven:
                why = await self._proof(n)
                if why is not None:
                    return self._refuse(n, why)
                n.proven = True
            asked = {k: tuple(v) for k, v in n.sent.items()}  # what the report will already count
            body = await self._client.load(n.url)
            was_routable, before = n.view().routable, n.routable_models()
            n.load, n.healthy, n.failures, n.seen, n.polled = body, True, 0, time.monotonic(), asked
            new = n.routable_models() - before
            if (n.view().routable and not was_routable) or new:
                log.info("node ready: %s (%s)%s", n.url, n.role, f": {', '.join(sorted(new))}" if new else "")
                self.changed.set()
            self._ask_cache(n)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:  # InvalidURL is no HTTPError: a URL httpx
            n.failures += 1  # refuses (a static or discovered one: the admin API checks its own) fails the check
            n.proven = False  # not routed to again before it answers a new challenge (a squatter on its port cannot)
            if n.failures >= self.max_failures and n.healthy:
                log.warning("node evicted after %d failed health checks: %s (%s)", n.failures, n.url, e)
                n.healthy = False
                self._forget(n.url)

    def _ask_cache(self, n: NodeState) -> None:
        """Ask for the node's cache in the background, one ask per node at a time: the node answers between two
        engine steps (up to a prefill chunk's step later), and the health poll must not wait for that."""
        if self.index is None or n.url in self._cache_asks:
            return
        task = asyncio.ensure_future(self._poll_cache(n))
        self._cache_asks[n.url] = task
        task.add_done_callback(lambda t, url=n.url: self._cache_asks.pop(url, None) if self._cache_asks.get(url)
                               is t else None)  # fmt: skip

    async def _poll_cache(self, n: NodeState) -> None:
        """The node's prefix cache since its last report into the index (a draining node: out of it). A node
        that cannot say (an older one, a slow engine) is left out until it can: routed by load meanwhile."""
        if self.index is None:
            return
        if not n.view().routable or self.nodes.get(n.url) is not n:
            return self._forget(n.url)
        try:
            report = await self._client.cache(n.url, self.index.cursors(n.url))
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            log.debug("prefix cache of %s not read: %s", n.url, e)
            return self._forget(n.url)
        if self.nodes.get(n.url) is n and not n.draining:  # not removed or marked draining meanwhile
            self.index.apply(n.url, report)

    async def wait_changed(self, timeout: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
