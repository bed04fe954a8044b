"""RuntimePool: the warm pool — models placed on interchangeable node runtimes, keyed by (model, role).

Two levels of actuator (autoscaler/actuator.py): a *runtime actuator* (LocalActuator, KubernetesActuator)
runs n runtimes per role, started empty (standby); this pool, the loop's actuator, places models on them.
A replica of the key (m, r) is a runtime of role r whose ``/load`` says it holds m. Scaling up claims a
runtime that is already running and injects m (weights from the store through its node cache: about a
second) — not a process start (imports, tens of seconds on a busy CPU).

One tick (the loop calls ``current()`` first, then ``prepare`` / ``scale`` per key):
 1. observe    ``runtimes.current()`` gives the runtime processes; each one up is read at ``GET /load``
               (internal token): its state, the models it holds (state per model), memory budget and use,
               and ``cached`` (the fraction of a model's shards its node cache holds);
 2. reconcile  each key ``scale()`` was asked about goes to its desired count:
               short -> claim: ``POST /internal/models/load`` on the best runtime of role r not holding m
               (``rank``, autoscaler/placement.py), with ``keep``: the models there the node must not
               evict to make room (those still wanted that became ready within ``protect_s`` and served
               nothing since: the request held for them is on its way); a 503 (no room) moves on to the
               next candidate, as does a runtime that cannot start the load within half the call's timeout
               (an unload draining there holds its turn; the node then does nothing, so a claim never
               lands on two runtimes); none left: the deficit waits for a runtime from step 3. A model a claim
               evicted is at 0 replicas at once (its desired count; the policy or the activator brings it
               back on demand);
               surplus -> unload: ``POST /internal/models/unload`` in a background thread (that model
               drains on the runtime, bounded, then its weights and KV are freed): the runtime returns to
               the pool. Loading replicas go first, then the one with the fewest active requests;
 3. refill     runtimes per role = max(``min_runtimes[role]``, busy (holding a model) + ``pool_size``), capped
               at ``max_runtimes[role]`` (while claims wait for runtimes: busy + those claims, never fewer
               than run — capacity first, on a small box the refill follows once they are placed). The
               minimum is the plan's count (``pdserve up``) or ``{role}_min_replicas``: those runtimes
               stay up, standby when nothing is held, so a pool that cannot hold every model swaps
               models on its runtimes instead of stopping and starting processes. The cap is
               ``{role}_max_replicas`` (at least the minimum): standby runtimes count within it, so a
               pool at its cap keeps no standby one and serves a new model by evicting an idle one;
               a spare (beyond the minimum and the claims waiting) starts only once no runtime of the
               role is loading: a process start beside a load slows it on a small box (measured, 2
               cores: a claimed SmolLM2 load 0.3 s alone, 0.56-0.79 s beside a node's start;
               thread niceness does not help across sessions, each its own autogroup: the local actuator
               keeps its nodes in its own session); the surplus
               leaves starting runtimes first, then standby ones (``scale(role, n, prefer_remove=urls)``,
               the least cached first). New runtimes are the runtime actuator's to start (LocalActuator:
               ``--import-nice``, so a refill's imports yield the CPU to the nodes that serve).

The records and the ranking (``PoolConfig``, ``pool_config``, ``Runtime``, ``rank``) live in
autoscaler/placement.py; this module re-exports them (``from autoscaler.pool import PoolConfig`` still works).

Concurrency: ``current`` / ``scale`` / ``prepare`` come from the loop's thread; unloads run in daemon
threads and ``status()`` (``pdserve status``) from any thread: the shared records are under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping

import httpx

from compute.node.auth import Prover
from compute.node.client import NodeFailed, RequestRejected, SyncNodeClient
from compute.node.protocol import ModelLoad, ModelLoadRequest, ModelUnloadRequest

from .actuator import Actuator, NodeInfo
from .placement import HOLDING, Key, PoolConfig, Runtime, pool_config, rank

__all__ = ["HOLDING", "Key", "PoolConfig", "Runtime", "RuntimePool", "pool_config", "rank"]

log = logging.getLogger("pdserve.autoscaler")


class RuntimePool(Actuator):
    """The loop's actuator over a runtime actuator (see the module doc); keys are (model, role)."""

    def __init__(self, runtimes: Actuator, token: str | None, config: PoolConfig | None = None,
                 roles: tuple[str, ...] = ("prefill", "decode")):  # fmt: skip
        """`token`: the internal token, which signs the pool's requests to the runtimes (never sent)."""
        self.runtimes, self.config, self.roles = runtimes, config or PoolConfig(), tuple(roles)
        self._http = SyncNodeClient(token, timeout_s=self.config.http_timeout_s)
        # a runtime proves the token at its URL before it is read or claimed (none: nothing is signed either)
        self._prover = Prover(token, timeout_s=min(self.config.http_timeout_s, 2.0)) if token else None
        self._lock = threading.Lock()  # the records below (status() reads them from other threads)
        self.view: dict[str, Runtime] = {}  # url -> runtime, as of the last observe
        self._desired: dict[Key, int] = {}  # keys scale() was asked about
        self._unloading: set[tuple[str, str]] = set()  # (model, url) being unloaded
        self._claims: deque[dict] = deque(maxlen=self.config.history)
        self.claims_done = 0
        self.last_placement: dict | None = None
        self._unmet: dict[str, int] = {}  # role -> claims that found no runtime (refill starts one)
        self._ready_at: dict[tuple[str, str], float] = {}  # (model, url) -> when first seen ready

    # --- the key-level contract ---------------------------------------------------------
    def current(self) -> dict[Key, list[NodeInfo]]:
        """Observe every runtime, reconcile the keys, refill the pool; then the replicas per key."""
        self._observe()
        self._reconcile()
        self._refill()
        out: dict[Key, list[NodeInfo]] = {}
        with self._lock:
            for rt in self.view.values():
                for m, d in rt.models.items():
                    state = "draining" if (m, rt.url) in self._unloading else d.state
                    if state in (*HOLDING, "draining"):
                        out.setdefault((m, rt.role), []).append(
                            NodeInfo(rt.role, rt.url, state == "ready", name=rt.name, state=state))
        return out

    def replicas(self, key: Key) -> int:
        """Replicas asked for: the desired count once scale() was asked, else the runtimes holding the model."""
        with self._lock:
            if key in self._desired:
                return self._desired[key]
            return len(self._holders(key))

    def scale(self, key: Key, replicas: int) -> None:
        """Claim (inject) or unload until `replicas` runtimes of the role hold the model; returns at once."""
        _, role = key
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not one of this pool's ({', '.join(self.roles)})")
        with self._lock:
            self._desired[key] = replicas
        self._reconcile()
        self._refill()

    def capacity(self, serving: tuple[str, ...] | None = None) -> tuple:
        """The runtime actuator's bounds on serving nodes (autoscaler/capacity.py), counted over the runtimes
        that hold a model or are still starting (a start is a claim waiting for it, or a refill that will use
        cores the same); a standby runtime is not serving: claiming one is what the bound allows or not."""
        fn = getattr(self.runtimes, "capacity", None)
        if fn is None:
            return ()
        with self._lock:
            serving = tuple(rt.url for rt in self.view.values() if rt.busy or not rt.up)
        return tuple(fn(serving))

    def prepare(self, key: Key, replicas: int) -> None:
        """Nothing: a claim loads through the chosen runtime's node cache, and the ranking prefers the runtime
        whose cache already holds the model."""

    def place(self, models: list[str], counts: Mapping[str, int]) -> None:
        """Ask for `counts[role]` replicas of every model (the models `pdserve up` serves from the start)."""
        for m in models:
            for role, n in counts.items():
                with self._lock:
                    self._desired[(m, role)] = n

    def close(self) -> None:
        self._http.close()
        if self._prover is not None:
            self._prover.close()

    # --- observe ------------------------------------------------------------------------
    def _observe(self) -> None:
        nodes = self.runtimes.current()
        seen: dict[str, Runtime] = {}
        for role in self.roles:
            for n in nodes.get(role, []):
                rt = Runtime(role, n.url, n.name, up=n.ready)
                if n.ready:
                    self._read(rt)
                seen[n.url] = rt
        now = time.time()
        with self._lock:
            for rt in seen.values():
                old = self.view.get(rt.url)
                if old is not None and not rt.reachable and old.reachable:
                    rt.models, rt.state = old.models, "unreachable"  # one missed read: keep what it held
            self.view = seen
            self._unloading = {(m, u) for m, u in self._unloading if u in seen}
            for rt in seen.values():
                for m, d in rt.models.items():
                    if d.state == "ready":
                        self._ready_at.setdefault((m, rt.url), now)
            self._ready_at = {k: v for k, v in self._ready_at.items()
                              if k[1] in seen and (seen[k[1]].models.get(k[0]) or not seen[k[1]].reachable)}  # fmt: skip
            for c in self._claims:  # claim -> ready, as first seen
                rt = seen.get(c["url"])
                if c["ready_s"] is None and rt and (m := rt.models.get(c["model"])) is not None and m.state == "ready":
                    c["ready_s"] = round(now - c["t"], 3)

    def _read(self, rt: Runtime) -> None:
        if self._prover is not None and not self._prover.proven(rt.url):
            log.warning("pool: %s did not prove the internal token: not read, not claimed", rt.url)
            rt.state = "unproven"  # as unreachable: nothing is sent to it
            return
        try:
            body = self._http.load(rt.url)
        except (httpx.HTTPError, ValueError):
            if self._prover is not None:
                self._prover.forget(rt.url)  # whatever answers there next proves itself first
            rt.state = "unreachable"
            return
        rt.reachable = True
        rt.state, rt.models, rt.cached = body.state, dict(body.models), dict(body.cached)
        rt.budget, rt.used = body.memory_budget_bytes, body.memory_used_bytes

    def _holders(self, key: Key) -> list[Runtime]:
        """(holding _lock) Runtimes of the key's role holding its model, not being unloaded."""
        m, role = key
        return [rt for rt in self.view.values()
                if rt.role == role and rt.holds(m) and (m, rt.url) not in self._unloading]  # fmt: skip

    # --- reconcile ----------------------------------------------------------------------
    def _reconcile(self) -> None:
        self._unmet = {}
        with self._lock:
            keys = dict(self._desired)
        for key, want in keys.items():
            with self._lock:
                have = self._holders(key)
            if len(have) < want:
                missed = sum(1 for _ in range(want - len(have)) if not self._claim(key))
                # models may share a runtime: the role needs as many new runtimes as its largest deficit
                self._unmet[key[1]] = max(self._unmet.get(key[1], 0), missed)
            elif len(have) > want:
                leaving = sorted(have, key=lambda rt: (rt.models[key[0]].state == "ready",
                                                       rt.models[key[0]].active_requests, rt.url))
                for rt in leaving[: len(have) - want]:
                    self._unload(key[0], rt)

    def _claim(self, key: Key) -> bool:
        """Inject the model into the best runtime that takes it; False if none would."""
        model, role = key
        with self._lock:
            wanted = {m for (m, r), n in self._desired.items() if r == role and n > 0 and m != model}
            keep = {rt.url: self._protected_locked(rt, wanted) for rt in self.view.values() if rt.role == role}
            candidates = rank(list(self.view.values()), model, role, self._need_bytes_locked(model), wanted, keep)
        for rt, why in candidates:
            t = time.time()
            try:
                # wait_s: the node starts the load within half our timeout or refuses it (503) and does nothing;
                # a load left waiting behind an unload's drain would land after this claim went elsewhere
                body = self._http.load_model(rt.url, ModelLoadRequest(
                    model, keep=sorted(keep[rt.url]), wait_s=self.config.http_timeout_s / 2))
            except RequestRejected as e:
                if e.status != 404:
                    log.info("pool: %s refused %s (%d: %s); next runtime", rt.url, model, e.status, e)
                    continue
                log.error("pool: %s is not in the store (%s): not placing it", model, e)
                with self._lock:
                    self._desired[key] = len(self._holders(key))
                self._record(key, rt, why, t, f"not in the store: {e}")
                return True  # nothing to wait for
            except NodeFailed as e:
                log.info("pool: load %s on %s failed: %s; next runtime", model, rt.url, e)
                continue
            with self._lock:
                rt.models[model] = ModelLoad(model=model, state=body.state)
                for gone in body.evicted:
                    rt.models.pop(gone, None)
                    k = (gone, role)
                    if k in self._desired:  # at 0 at once where this was its only replica
                        self._desired[k] = max(0, min(self._desired[k], len(self._holders(k))))
                    self._ready_at.pop((gone, rt.url), None)
            self._record(key, rt, why, t, "", evicted=list(body.evicted))
            log.info("pool: claimed %s (%s) for %s: %s", rt.url, rt.name, model, why)
            return True
        return False

    def _protected_locked(self, rt: Runtime, wanted: set[str]) -> set[str]:
        """(holding _lock) Models on ``rt`` a claim must not evict: wanted, and loading, or ready within
        protect_s without having served a request since (one held for it is being routed to it now)."""
        now, out = time.time(), set()
        for m, d in rt.models.items():
            if m not in wanted:
                continue
            ready_t = self._ready_at.get((m, rt.url), now)  # ready but not seen so yet: just now
            unserved = (d.last_used or 0) < ready_t  # the request it was claimed for is still coming
            if d.state == "loading" or (unserved and now - ready_t < self.config.protect_s):
                out.add(m)
        return out

    def _need_bytes_locked(self, model: str) -> int:
        """(holding _lock) The model's size as some runtime reported it (0: not known yet)."""
        sizes = [rt.models[model].bytes for rt in self.view.values() if model in rt.models]
        return max(sizes, default=0)

    def _record(self, key: Key, rt: Runtime, why: str, t: float, error: str, evicted: list | None = None) -> None:
        row = {"t": t, "model": key[0], "role": key[1], "url": rt.url, "name": rt.name, "why": why,
               "error": error, "evicted": evicted or [], "ready_s": None}  # fmt: skip
        with self._lock:
            self._claims.append(row)
            self.last_placement = row
            self.claims_done += 0 if error else 1

    def _unload(self, model: str, rt: Runtime) -> None:
        with self._lock:
            if (model, rt.url) in self._unloading:
                return
            self._unloading.add((model, rt.url))
        threading.Thread(target=self._unload_now, args=(model, rt.url), name=f"unload-{model}", daemon=True).start()

    def _unload_now(self, model: str, url: str) -> None:
        timeout = self.config.unload_timeout_s
        try:
            if self._prover is not None and not self._prover.proven(url):
                raise NodeFailed(url, "did not prove the internal token")
            r = self._http.unload_model(url, ModelUnloadRequest(model, timeout))
            log.info("pool: unloaded %s from %s (drained: %s)", model, url, r.drained)
        except (NodeFailed, RequestRejected) as e:
            log.warning("pool: unload of %s from %s failed: %s", model, url, e)
        finally:
            with self._lock:
                rt = self.view.get(url)
                if rt is not None:
                    rt.models.pop(model, None)  # until the next /load read says otherwise
                self._unloading.discard((model, url))

    # --- refill -------------------------------------------------------------------------
    def _refill(self) -> None:
        """Runtimes per role = max(min, busy + (unmet claims or pool_size)), capped; standby ones leave first."""
        for role in self.roles:
            with self._lock:
                mine = [rt for rt in self.view.values() if rt.role == role]
                busy = [rt for rt in mine if rt.up and rt.busy]  # (up, unreachable, nothing known: neither)
                spare = sorted((rt for rt in mine if rt.standby), key=lambda rt: (sum(rt.cached.values()), rt.url))
                starting = [rt for rt in mine if not rt.up]  # cheaper to lose than a warm one: they go first
                loading = any(m.state == "loading" for rt in mine for m in rt.models.values())
            unmet = self._unmet.get(role, 0)  # while claims wait for runtimes only those start: capacity first
            want = max(self.config.floor(role), len(busy) + (unmet or self.config.pool_size))
            want = max(len(busy), min(self.config.cap(role), want))
            have = self.runtimes.replicas(role)
            if unmet:  # no shrinking while claims wait: the runtimes starting (or restarting) are theirs
                want = max(want, have)
            elif want > max(have, self.config.floor(role)) and loading:
                want = max(have, self.config.floor(role))  # the spare waits for the loads (see step 3)
            if want != have:
                log.info("pool: %s runtimes -> %d (%d busy, %d standby, pool %d)", role, want, len(busy), len(spare),
                         self.config.pool_size)  # fmt: skip
                self.runtimes.scale(role, want, prefer_remove=tuple(rt.url for rt in starting + spare))

    # --- pdserve status -----------------------------------------------------------------
    def status(self) -> dict:
        """Runtimes (url, role, state, models held), claims done, the last placement and why, desired per key."""
        with self._lock:
            rts = [{"url": rt.url, "role": rt.role, "name": rt.name,
                    "state": "standby" if rt.standby else rt.state,
                    "models": {m: ("draining" if (m, rt.url) in self._unloading else d.state)
                               for m, d in rt.models.items()},
                    "memory_used_bytes": rt.used, "memory_budget_bytes": rt.budget}
                   for rt in sorted(self.view.values(), key=lambda r: (r.role, r.url))]  # fmt: skip
            return {"pool_size": self.config.pool_size, "runtimes": rts, "claims_done": self.claims_done,
                    "max_runtimes": {r: self.config.cap(r) for r in self.roles},
                    "claims": list(self._claims), "last_placement": self.last_placement,
                    "desired": {f"{m}/{r}": n for (m, r), n in sorted(self._desired.items())}}  # fmt: skip
