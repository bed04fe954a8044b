"""The node registry: which nodes exist, their role, health and load.

Fed by static config, by the local launcher / autoscaler (``add``/``remove``,
also over the admin API) or by Kubernetes endpoints. A health loop polls each
node's ``/load``: ``health_failures`` consecutive failures evict a node from
routing (it stays known and is re-admitted when it answers again); a node still
loading weights reports ready=false and is not routed to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from .router import NodeView

log = logging.getLogger("pdserve.gateway")


@dataclass(slots=True)
class NodeState:
    url: str
    role: str
    healthy: bool = False  # answered its last health checks
    failures: int = 0
    load: dict = field(default_factory=dict)  # last /load
    seen: float = 0.0  # monotonic time of the last answer
    source: str = "static"
    draining: bool = False  # told by the actuator before it drains the node: stop routing at once

    def view(self) -> NodeView:
        ld = self.load
        return NodeView(
            url=self.url, role=self.role, ready=self.healthy and bool(ld.get("ready")),
            draining=self.draining or bool(ld.get("draining")), queued_prompt_tokens=int(ld.get("queued_prompt_tokens", 0)),
            running=int(ld.get("running", 0)), kv_blocks_free=int(ld.get("kv_blocks_free", 0)),
        )  # fmt: skip

    def as_dict(self) -> dict:
        state = "unhealthy" if not self.healthy else ("draining" if self.draining or self.load.get("draining") else
                                                      ("ready" if self.load.get("ready") else "loading"))  # fmt: skip
        return {"url": self.url, "role": self.role, "state": state, "load": self.load, "source": self.source}


class NodeRegistry:
    def __init__(self, headers: dict[str, str], interval_s: float = 0.5, failures: int = 2):
        self.nodes: dict[str, NodeState] = {}
        self.headers = headers
        self.interval_s = interval_s
        self.max_failures = failures
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set whenever a node becomes routable

    def add(self, url: str, role: str, source: str = "static") -> NodeState:
        url = url.rstrip("/")
        if url not in self.nodes:
            self.nodes[url] = NodeState(url, role, source=source)
            log.info("node registered: %s (%s, %s)", url, role, source)
        return self.nodes[url]

    def remove(self, url: str) -> bool:
        return self.nodes.pop(url.rstrip("/"), None) is not None

    def mark_draining(self, url: str) -> None:
        """The node is about to drain: no new request goes to it from now on (its streams go on)."""
        n = self.nodes.get(url.rstrip("/"))
        if n:
            n.draining = True

    async def refresh(self, url: str) -> None:
        """Check one node now (a node just announced ready is routable without waiting a poll)."""
        n = self.nodes.get(url.rstrip("/"))
        if n is not None and self._client is not None:
            await self._check(n)

    def views(self) -> list[NodeView]:
        return [n.view() for n in self.nodes.values()]

    def suspect(self, url: str) -> None:
        """A request failed on this node: stop routing to it until its next good health check."""
        n = self.nodes.get(url)
        if n:
            n.healthy = False

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), headers=self.headers)
        await self.poll_once()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad poll
                log.exception("health poll failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._check(n) for n in list(self.nodes.values())))

    async def _check(self, n: NodeState) -> None:
        try:
            r = await self._client.get(n.url + "/load")
            r.raise_for_status()
            was_routable = n.view().routable
            n.load, n.healthy, n.failures, n.seen = r.json(), True, 0, time.monotonic()
            if n.view().routable and not was_routable:
                log.info("node ready: %s (%s)", n.url, n.role)
                self.changed.set()
        except (httpx.HTTPError, ValueError) as e:
            n.failures += 1
            if n.failures >= self.max_failures and n.healthy:
                log.warning("node evicted after %d failed health checks: %s (%s)", n.failures, n.url, e)
                n.healthy = False

    async def wait_changed(self, timeout: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
