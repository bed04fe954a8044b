"""The models one node runtime holds: load, unload and eviction within a memory budget.

Lifecycle of one held model (a ``Held``, keyed by the name it was asked to load):
 1. ``load(name)``: the name is resolved in the store (``ModelUnknown``: 404) and its memory estimated
    from the manifest (weights as the runtime will hold them + ``kv_blocks`` of its KV layout + the
    transient of the load itself: the decoded shards the reader holds in flight, ``transient_bytes``;
    at least one shard is reserved, and the reader's prefetch is cut to what the room left allows, so
    the budget holds during the load, not only after). No room in the budget: the least recently used
    *idle* models are evicted (unloaded) until it fits — ``NodeBusy`` (503) and nothing evicted when
    even evicting every idle one would not make room. Loads and unloads decide one at a time, and an
    unload holds that turn while its model drains (up to its bound): a caller that gives up sooner (the
    warm pool's claim) sends ``wait_s``, and a load that cannot start within it is a 503 that does
    nothing — never a load performed after its caller went elsewhere;
 2. ``loading``: a background thread injects the weights (``WeightInjector``; progress in /load), then
    builds the model's engine (its KV cache), ``NodeService``, KV sender or receiver and engine thread
    (``held.build``) -> ``ready``, its bytes now measured from the tensors it holds;
 3. requests naming it (or naming none, when it is the only one) go to its service (``service``) and
    mark it used (the LRU order);
 4. ``unload`` / eviction: ``draining`` — its new requests get 503, its active ones finish (bounded;
    those still running past the bound end with ``abort``) — then ``held.free``: engine thread stopped,
    KV sender/receiver closed (transfer registration gone), weights and KV cache dropped and handed back
    to the OS. A load that fails is ``failed`` with its error (loading the name again retries).
The host's state is only touched on the event loop; the load thread publishes through ``Held``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from compute.modeling.loader import LoadProgress, transient_bytes
from compute.node import protocol as P
from compute.node.config import NodeConfig
from compute.node.errors import BadNodeRequest, ModelNotLoaded, NodeBusy
from compute.node.held import Held, estimate_bytes, free, mem_available, rss_bytes
from compute.node.protocol import ModelLoadReply, ModelUnloadReply
from compute.node.service import NodeService

log = logging.getLogger("pdserve.node")
PREFETCH = 2  # shards a load keeps in flight when the budget has room for them (ReaderConfig's default)
EVICT_DRAIN_S = 5.0  # an idle model has nothing in flight: this bounds only a race with a new request
class ModelUnknown(LookupError):
    """No such model (or version) in the store: HTTP 404."""


class ModelNotHeld(LookupError):
    """Unload of a model this node does not hold: HTTP 404."""


class ModelHost:
    def __init__(self, cfg: NodeConfig, store, cache, loop: asyncio.AbstractEventLoop):
        self.cfg, self.store, self.cache, self.loop = cfg, store, cache, loop
        self.budget_bytes = int(cfg.memory_gb * 2**30) if cfg.memory_gb else mem_available() // 2
        self.models: dict[str, Held] = {}
        self.draining = False
        self.start_model = cfg.model  # loaded at start: /ready waits for it
        self.start_ready = False
        self.cached: dict[str, float] = {}  # model -> fraction of its shard bytes in the node cache
        self._lock = asyncio.Lock()  # loads / unloads decide one at a time
        self._retiring: set[str] = set()  # models draining now (unload or eviction): the lock is held meanwhile

    # --- load / unload -------------------------------------------------------------------
    async def load(self, name, weights=None, keep=(), wait_s=None) -> tuple[int, ModelLoadReply]:
        """-> (202 | 200, the reply); ModelUnknown, BadNodeRequest, NodeBusy.
        ``keep``: models not to evict for this load (the pool's: a request is on its way to them);
        ``wait_s``: the longest wait for the host's turn (an unload draining holds it): past it, NodeBusy
        and nothing done (None: as long as it takes)."""
        if not isinstance(name, str) or not name.strip():
            raise BadNodeRequest("model must be a non-empty string NAME[@vN]")
        if not isinstance(keep, (list, tuple)) or not all(isinstance(k, str) for k in keep):
            raise BadNodeRequest("keep must be a list of model names")
        weights = self.cfg.weights if weights is None else weights
        if weights not in ("int8", "bf16", "fp32"):
            raise BadNodeRequest(f"invalid weights {weights!r}: int8, bf16 or fp32")
        if wait_s is not None and (isinstance(wait_s, bool) or not isinstance(wait_s, (int, float))
                                   or not 0 < wait_s <= 3600):  # fmt: skip
            raise BadNodeRequest("wait_s must be a number of seconds in (0, 3600]")
        try:
            await asyncio.wait_for(self._lock.acquire(), wait_s)  # acquired at the timeout: kept, and used
        except TimeoutError:
            what = f"unloading {', '.join(sorted(self._retiring))}" if self._retiring else "another load or unload"
            raise NodeBusy(f"busy for {wait_s:g} s ({what}): {name!r} not loaded; try another runtime, or again "
                           "later") from None
        try:
            return await self._load_locked(name, weights, keep)
        finally:
            self._lock.release()

    async def _load_locked(self, name: str, weights: str, keep) -> tuple[int, ModelLoadReply]:
        """``load`` with the host's turn held."""
        if self.draining:
            raise NodeBusy("node is draining")
        h = self.models.get(name)
        if h is not None and h.state != "failed":
            return 200, ModelLoadReply(name, h.state)
        manifest = await asyncio.to_thread(self._manifest, name)
        self.cached[name] = await asyncio.to_thread(self.cached_fraction, manifest)
        wb, kb = estimate_bytes(manifest, weights, self.cfg)
        self.models.pop(name, None)  # a failed earlier load: retry
        evicted = []
        for v in self._victims(name, wb + kb + transient_bytes(manifest, 1), set(keep)):
            await self._retire(v, EVICT_DRAIN_S)
            evicted.append(v.name)
        room = self.budget_bytes - self.used_bytes() - wb - kb
        prefetch = max((p for p in range(1, PREFETCH + 1) if transient_bytes(manifest, p) <= room), default=1)
        h = Held(name, weights, manifest, wb, kb, transient_bytes(manifest, prefetch), prefetch)
        self.models[name] = h
        h.start(self.cfg, self.store, self.cache, self.loop, on_ready=self._on_ready)
        if evicted:
            log.info("evicted %s to load %s", ", ".join(evicted), name)
        return 202, ModelLoadReply(name, h.state, evicted)

    async def unload(self, name, timeout_s=30.0) -> ModelUnloadReply:
        """Drain ``name`` (bounded), then free it; ModelNotHeld."""
        if not isinstance(name, str) or name not in self.models:
            raise ModelNotHeld(f"model {name!r} is not held here")
        try:
            timeout_s = float(timeout_s)
        except (TypeError, ValueError):
            raise BadNodeRequest("timeout_s must be a number") from None
        if not 0 <= timeout_s <= 3600:
            raise BadNodeRequest("timeout_s must be in [0, 3600]")
        async with self._lock:
            h = self.models.get(name)
            if h is None:
                raise ModelNotHeld(f"model {name!r} is not held here")
            drained = await self._retire(h, timeout_s)
        return ModelUnloadReply(True, drained)

    async def drain(self, timeout_s: float) -> bool:
        """The whole node: refuse new requests and loads, wait (bounded) for every model's active ones."""
        self.draining = True
        svcs = [h.svc for h in list(self.models.values()) if h.svc is not None]
        done = await asyncio.gather(*(s.drain(timeout_s) for s in svcs))
        return all(done)

    def close(self) -> None:
        """Process exit: stop every engine thread and transfer endpoint."""
        for h in list(self.models.values()):
            h.cancel()
            free(h, wait_load_s=2.0)
        self.models.clear()

    def survey(self, limit: int = 64) -> None:
        """Any thread, once at start: ``cached`` for the store's models (placement prefers a runtime
        whose cache holds a model's shards). Best effort: a store that cannot be listed is skipped."""
        if self.cache is None:
            return
        try:
            names = sorted(self.store.models())[:limit]
            for name in names:
                if name not in self.cached:
                    self.cached[name] = self.cached_fraction(self.store.manifest(name))
        except Exception as e:  # noqa: BLE001 - only a hint for placement
            log.warning("cannot survey the node cache: %s", e)

    def _manifest(self, name: str):
        from paramstore.errors import InvalidRequest, NotFound

        try:
            return self.store.manifest(name)
        except NotFound as e:
            raise ModelUnknown(f"model {name!r} is not in the store: {e}") from None
        except InvalidRequest as e:
            raise BadNodeRequest(f"bad model reference {name!r}: {e}") from None

    def _victims(self, name: str, need: int, keep: set[str] = frozenset()) -> list[Held]:
        """The idle models (not in ``keep``) to evict, LRU first, so that ``need`` bytes fit; NodeBusy if
        they cannot."""
        free_b = self.budget_bytes - self.used_bytes()
        if need <= free_b:
            return []
        idle = sorted((h for h in self.models.values() if h.idle() and h.name not in keep),
                      key=lambda h: h.last_used or h.created)  # fmt: skip
        out = []
        for h in idle:
            out.append(h)
            free_b += h.bytes
            if need <= free_b:
                return out
        busy = [h.name for h in self.models.values() if not h.idle() or h.name in keep]
        raise NodeBusy(f"no room for {name!r}: needs {need / 2**20:.1f} MiB, budget {self.budget_bytes / 2**20:.1f} "
                       f"MiB, {(self.budget_bytes - self.used_bytes()) / 2**20:.1f} MiB free"
                       + (f"; busy models: {', '.join(busy)}" if busy else ""))  # fmt: skip

    async def _retire(self, h: Held, timeout_s: float) -> bool:
        """Drain then free one model; the host forgets it. True if nothing was cut short."""
        h.cancel()  # a load still running stops after its current shard (first: it cannot turn ready after this)
        h.state = "draining"
        drained = True
        self._retiring.add(h.name)
        try:
            if h.svc is not None:
                drained = await h.svc.drain(timeout_s)
                h.end_streams("model unloaded")
            await asyncio.to_thread(free, h)
        finally:
            self._retiring.discard(h.name)
        self.models.pop(h.name, None)
        self.cached[h.name] = await asyncio.to_thread(self.cached_fraction, h.manifest)
        log.info("unloaded %s (drained=%s); %.1f MiB used, RSS %.1f MiB", h.name, drained,
                 self.used_bytes() / 2**20, rss_bytes() / 2**20)  # fmt: skip
        return drained

    def _on_ready(self, h: Held) -> None:
        """Load thread: the model is ready."""
        if h.name == self.start_model:
            self.start_ready = True
        self.cached[h.name] = self.cached_fraction(h.manifest)

    # --- requests ------------------------------------------------------------------------
    def service(self, name: str | None) -> NodeService:
        """The ready service a request's ``model`` names (None: the only model); marks it used."""
        if name is None:
            live = [h for h in self.models.values() if h.state != "failed"]
            if len(live) > 1:
                raise BadNodeRequest(f"this node holds several models ({', '.join(self.models)}): name one in 'model'")
            if not live:
                raise ModelNotLoaded("node is draining" if self.draining else "no model is loaded on this node")
            h = live[0]
        elif not isinstance(name, str):
            raise BadNodeRequest("model must be a string")
        elif (h := self.models.get(name)) is None:
            raise ModelNotLoaded(f"model {name!r} is not held by this node")
        if h.state != "ready" or h.svc is None:
            raise ModelNotLoaded(f"model {h.name!r} is {h.state} on this node" + (f": {h.error}" if h.error else ""))
        h.last_used = time.time()
        return h.svc

    def services(self) -> list[NodeService]:
        return [h.svc for h in list(self.models.values()) if h.svc is not None]

    # --- views ---------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(h.bytes for h in self.models.values() if h.state != "failed")

    def cached_fraction(self, manifest) -> float:
        shards = manifest.weight_shards()
        total = sum(s.size for s in shards)
        if self.cache is None or not total:
            return 0.0
        return sum(s.size for s in shards if self.cache.contains(s.digest)) / total

    def state(self) -> str:
        states = {h.state for h in self.models.values()}
        if self.draining:
            return "draining"
        return "ready" if "ready" in states else "loading" if "loading" in states else "standby"

    def ready(self) -> bool:
        """/ready: not draining, and the start model (if any) has been ready."""
        return not self.draining and (self.start_model is None or self.start_ready)

    def start_progress(self) -> dict:
        h = self.models.get(self.start_model) if self.start_model else None
        if h is None:
            h = next(iter(self.models.values()), None)
        return h.progress.as_dict() if h is not None else LoadProgress().as_dict()

    def view(self) -> P.LoadReport:
        """GET /load (contract A): per model, and today's fields summed over the models."""
        models = {name: h.view(self.cfg, self.draining) for name, h in list(self.models.items())}
        ready = [n for n, m in models.items() if m.state == "ready"]
        summed = {f: sum(getattr(m, f) for m in models.values()) for f in P.EngineLoad.__struct_fields__}
        return P.LoadReport(
            role=self.cfg.role, state=self.state(), ready=bool(ready), draining=self.draining,
            model=ready[0] if ready else None, models=models, memory_budget_bytes=self.budget_bytes,
            memory_used_bytes=self.used_bytes(), cached=dict(self.cached), rss_bytes=rss_bytes(),
            kv_transport=self.cfg.kv_transport if self.cfg.role != "both" else None,
            progress=self.start_progress(), **summed,
        )  # fmt: skip

    def models_view(self) -> P.ModelsReport:
        """GET /internal/models."""
        return P.ModelsReport(models=[h.view(self.cfg, self.draining) for h in list(self.models.values())],
                              memory_budget_bytes=self.budget_bytes, memory_used_bytes=self.used_bytes())
