"""The LoRA adapters one held model serves: fetched from the store on first use, kept in memory, least recently used
out first.

Lifecycle of a request naming an adapter (``SamplingParams.adapter``: its ``NAME@vN`` and content digest):
 1. ``acquire(ref)`` on the event loop: a hit returns the kept ``LoraWeights`` at once; a miss fetches the adapter
    from the store in a worker thread (any k of n fragments per shard, through the node cache like a model's shards:
    ``paramstore/adapters.py``), checks that it adapts this model's weights (its pinned base) and that its digest is
    the one asked for, fuses its pairs (``compute/modeling/lora.py``) and keeps it. Concurrent misses of one adapter
    share one fetch. When the bounds are reached and every kept adapter is in use, the request waits for one to be
    released (at most ``WAIT_S``; waiters resume in the order they came), so a rarely used adapter is late, not
    refused. A refusal is ``BadNodeRequest`` (not an adapter of this model, another digest) or ``NodeBusy`` (still
    no room after the wait, or one adapter larger than ``max_lora_mb``: retry elsewhere).
 2. the sequence carries the weights (``seq.lora``) for its life: the runner groups its rows by adapter;
 3. ``release(ref)`` when the request ends on this node: the adapter stays kept, no longer pinned.
Bounds: ``max_loras`` adapters and ``max_lora_mb`` of their pairs; an adapter in use is never evicted (a sequence
holds its weights anyway: eviction only drops the cache's reference).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from compute.engine.sampling import AdapterRef
from compute.modeling.config import ModelConfig
from compute.modeling.lora import LoraWeights, pair_dtype
from compute.node.errors import BadNodeRequest, NodeBusy

WAIT_S = 30.0  # how long a request waits for an in-use adapter to be released when the node keeps its maximum
LOAD_SECONDS = Histogram("pdserve_node_lora_load_seconds", "A LoRA adapter fetched from the store and fused, on a miss",
                         ["model"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))  # fmt: skip
LOOKUPS = Counter("pdserve_node_lora_lookups_total", "Requests naming an adapter, by whether it was kept here",
                  ["model", "result"])  # fmt: skip


@dataclass(slots=True)
class _Kept:
    weights: LoraWeights
    users: int = 0


class AdapterCache:
    def __init__(self, model: str, base_ref: str, config: ModelConfig, store, node_cache=None, max_loras: int = 16,
                 max_bytes: int = 512 * 2**20, device: str = "cpu", weights: str = "fp32",
                 invariant: bool = False) -> None:  # fmt: skip
        """``base_ref``: the held model's ``NAME@vN`` (an adapter is served only on the weights it was made for);
        ``weights``: the base's runtime weights (its adapters' pairs are kept in ``pair_dtype(weights)``);
        ``invariant``: the node runs ``kernels = invariant`` (every adapter row by the row-invariant kernel)."""
        self.model, self.base_ref, self.config, self.device = model, base_ref, config, device
        self.dtype, self.invariant = pair_dtype(weights), invariant
        self.store, self.node_cache = store, node_cache
        self.max_loras, self.max_bytes = max_loras, max_bytes
        self._kept: OrderedDict[AdapterRef, _Kept] = OrderedDict()  # least recently used first
        self._loading: dict[AdapterRef, asyncio.Future] = {}
        self._freed: asyncio.Event | None = None  # set when an adapter stops being in use (created on the loop)
        self._tickets = itertools.count()  # a request's place in line, taken when it asks
        self._waiting: dict[int, None] = {}  # tickets of the requests waiting for room
        self.loads, self.last_load_s = 0, 0.0

    async def acquire(self, ref: AdapterRef) -> LoraWeights:
        ticket = next(self._tickets)
        kept = self._kept.get(ref)
        if kept is None:
            LOOKUPS.labels(self.model, "miss").inc()
            fut = self._loading.get(ref)
            if fut is None:
                fut = self._loading[ref] = asyncio.ensure_future(asyncio.to_thread(self._fetch, ref))
                fut.add_done_callback(lambda _f, r=ref: self._loading.pop(r, None))
            weights = await asyncio.shield(fut)
            if ref not in self._kept:
                await self._room_for(weights.nbytes, ticket)
            kept = self._kept.get(ref)  # another waiter for the same adapter may have kept it meanwhile
            if kept is None:
                kept = self._kept[ref] = _Kept(weights)
        else:
            LOOKUPS.labels(self.model, "hit").inc()
        self._kept.move_to_end(ref)
        kept.users += 1
        return kept.weights

    def release(self, ref: AdapterRef) -> None:
        kept = self._kept.get(ref)
        if kept is not None and kept.users > 0:
            kept.users -= 1
            if kept.users == 0 and self._freed is not None:
                self._freed.set()

    def report(self):
        """What /load says of them (``protocol.LoraLoad``)."""
        from compute.node.protocol import LoraLoad

        return LoraLoad(kept=[r.ref for r in self._kept], running=[r.ref for r, k in self._kept.items() if k.users],
                        waiting=[r.ref for r in self._loading], max_loras=self.max_loras, loads=self.loads,
                        load_seconds=self.last_load_s)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(k.weights.nbytes for k in self._kept.values())

    async def _room_for(self, incoming: int, ticket: int) -> None:
        """Evict unused adapters, least recently used first, until one more of ``incoming`` bytes fits; while every
        kept one is in use, wait for a release (up to ``WAIT_S``): the waiter that asked first takes the room."""
        if incoming > self.max_bytes:
            raise NodeBusy(f"adapter of {incoming} bytes exceeds max_lora_mb on this node")
        if not self._waiting and self._evict_for(incoming):
            return
        if self._freed is None:
            self._freed = asyncio.Event()
        deadline = time.monotonic() + WAIT_S
        self._waiting[ticket] = None
        try:
            while not (min(self._waiting) == ticket and self._evict_for(incoming)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NodeBusy(f"all {len(self._kept)} adapters kept on this node stayed in use for "
                                   f"{WAIT_S:.0f} s (max_loras)")  # fmt: skip
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            del self._waiting[ticket]
            if self._waiting:
                self._freed.set()  # the next in line looks again

    def _evict_for(self, incoming: int) -> bool:
        """Whether one more adapter of ``incoming`` bytes fits, after evicting idle ones as needed."""
        while len(self._kept) >= self.max_loras or self.nbytes + incoming > self.max_bytes:
            idle = next((r for r, k in self._kept.items() if k.users == 0), None)
            if idle is None:
                return False
            del self._kept[idle]
        return True

    def _fetch(self, ref: AdapterRef) -> LoraWeights:
        """Worker thread: the adapter from the store, checked against this model and the digest asked for."""
        from paramstore.errors import StoreError

        t0 = time.perf_counter()
        try:
            m = self.store.manifest(ref.ref)
            if m.adapter is None:
                raise BadNodeRequest(f"{ref.ref} is not an adapter")
            if m.adapter["base"] != self.base_ref:
                raise BadNodeRequest(f"{ref.ref} adapts {m.adapter['base']}, this node holds {self.base_ref}")
            if m.adapter["digest"] != ref.digest:
                raise BadNodeRequest(f"{ref.ref} in the store is not the adapter asked for (digest differs)")
            adapter = self.store.adapter(m, self.node_cache)
        except StoreError as e:
            raise BadNodeRequest(f"adapter {ref.ref}: {e}") from None
        if adapter.digest() != ref.digest:  # the shards were verified; this checks the whole, as named
            raise BadNodeRequest(f"adapter {ref.ref}: its tensors do not hash to its digest")
        weights = LoraWeights(adapter.targets, self.config, self.device, self.dtype, self.invariant)
        self.last_load_s = time.perf_counter() - t0
        LOAD_SECONDS.labels(self.model).observe(self.last_load_s)
        self.loads += 1
        return weights
