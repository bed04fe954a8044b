"""Pre-pull on join: a node that joins the pool pulls the hottest prefixes from their holders
before its first request for them, so a scale-up's new capacity starts warm.

Lifecycle (one ``Prepuller`` per gateway, over its registry and prefix index):
 1. every ``interval_s`` the registry's views are read; a node routable for a model for the first time since this
    gateway started is *new* (at start, every node is: the index is empty then, so nothing is pulled);
 2. for a new node, the model's ``chains`` most routed block-hash chains (``PrefixIndex.hottest``, counted at
    routing time): for each, the node whose cache report holds the longest run of it (``holder``); a chain the
    new node holds as far already is skipped;
 3. the holder exports the run by its block hashes (POST /internal/kv/export, no token ids), and the new node
    imports the handle (POST /internal/kv/import, compute/node/peer.py): the blocks land in its prefix cache
    under their hashes, and its next report tells the index;
 4. anything failing (a holder that evicted the chain, a node gone, no room) skips that chain: a pre-pull is an
    optimisation only. Chains are pulled one after another per node, bounded by ``chains``.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from compute.node.protocol import ExportRequest, ImportRequest
from gateway.routing.nodes import NodeFailed, RequestRejected

log = logging.getLogger("pdserve.gateway")
PREPULLED = Counter("pdserve_gateway_prepulled_blocks_total",
                    "KV blocks a joining node pulled from their holders before its first request for them")  # fmt: skip


class Prepuller:
    def __init__(self, registry, index, client, chains: int, interval_s: float = 1.0) -> None:
        self.registry, self.index, self.client = registry, index, client
        self.chains, self.interval_s = chains, interval_s
        self.seen: set[tuple[str, str]] = set()  # (node, model) routable once: not new any more
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Watch for new nodes until cancelled."""
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.interval_s)
        finally:
            for t in list(self._tasks):
                t.cancel()

    def tick(self) -> list[asyncio.Task]:
        """Start a pre-pull for each node newly routable for a model; returns the tasks started."""
        started = []
        for model in self.registry.routable_models():
            for v in self.registry.views(model):
                if not v.routable or (v.url, model) in self.seen:
                    continue
                self.seen.add((v.url, model))
                if self.index.hottest(model, 1):
                    task = asyncio.create_task(self.prepull(v.url, model))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    started.append(task)
        return started

    async def prepull(self, url: str, model: str) -> int:
        """Pull the model's hottest chains into ``url``'s cache; -> blocks pulled."""
        total = 0
        for hashes in self.index.hottest(model, self.chains):
            holder, n = self.index.holder(model, hashes, exclude=url)
            if holder is None or n <= self.index.held_run(model, hashes, url):
                continue
            try:
                reply = await self.client.export(holder, ExportRequest(block_hashes=hashes[:n],
                                                                       model=model))  # fmt: skip
                got = await self.client.import_kv(url, ImportRequest(reply.kv.reachable_from(holder), model))
            except (NodeFailed, RequestRejected) as e:
                log.info("pre-pull of a %d-block chain from %s to %s skipped: %s", n, holder, url, e)
                continue
            PREPULLED.inc(got.blocks)
            total += got.blocks
        if total:
            log.info("node %s joined: pre-pulled %d blocks of %s's hottest prefixes", url, total, model)
        return total
