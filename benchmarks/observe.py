"""The benchmarks' view of a running `pdserve up`: a sampler thread and the readers of a node's /load.

Lifecycle of one ``Sampler`` (over a started benchmarks/service.py ``UpService``):
 1. ``start``: a daemon thread ticks every ``interval_s``: each node's /load, read directly (sub-second
    timing of loading → ready, active requests); every ``slow_every`` ticks the node processes (/proc),
    their memory and the gateway's /internal/status snapshot (queue depth, the autoscaler's decisions);
 2. one row per tick in ``rows`` (the timeline);
 3. ``stop``: the thread ends (bounded join);
 4. reading the timeline: ``ready_nodes``, ``first`` (first ready / first active per role),
    ``first_scale_up`` (the first decision asking for more replicas), ``compact`` (thinned, counted per role).

The node views (``node_model_state`` and friends) read both /load shapes: per-model
(``models: {NAME: {...}}``) and the older one-model shape; ``count_ready`` / ``count_standby`` read them
through the gateway's snapshot.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.service import UpService


class Sampler:
    """A thread that watches the service: every ``interval_s`` each node's /load, read directly (so an
    event is timed to ~interval_s, not to the gateway's 0.5 s poll); every ``slow_every`` ticks the node
    processes (/proc), their memory and the gateway's snapshot (queue depth, the autoscaler's ask).

    ``rows``: {"t" (seconds since t0), "queue_depth", "asked",
               "decisions": {"model/role": [replicas, current, reason, slo]} (the autoscaler's last),
               "traffic": {NAME: [queue depth, held, running]} (the gateway's),
               "nodes": {url: {"role", "t", "state", "models": {NAME: [state, active requests, load s]},
                               "memory_used_bytes", "memory_budget_bytes"}}}
    """

    def __init__(self, svc: UpService, t0: float, interval_s: float = 0.1, slow_every: int = 5):
        self.svc, self.t0, self.interval_s, self.slow_every = svc, t0, interval_s, slow_every
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._nodes: dict[str, tuple[int, str]] = {}
        self._slow: dict = {}

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            t = time.monotonic()
            if tick % self.slow_every == 0:
                self._nodes = self.svc.nodes()
                self.svc.memory()
                st = self.svc.status() or {}
                auto = st.get("autoscaler") or {}
                roles = ((auto.get("decision") or {}).get("roles")) or {}
                self._slow = {"queue_depth": st.get("queue_depth"), "asked": auto.get("asked"),
                              "decisions": {k: [d.get("replicas"), d.get("current"), (d.get("reason") or "")[:120],
                                                d.get("slo", "")] for k, d in roles.items()},
                              "traffic": {m: [v.get("queue_depth"), v.get("held"), v.get("running")]
                                          for m, v in (st.get("models") or {}).items()}}  # fmt: skip
            row = {"t": round(t - self.t0, 3), **self._slow, "nodes": {}}
            for url, (_, role) in list(self._nodes.items()):
                load = self.svc.load(url)
                if load is None:
                    continue
                models = load.get("models") if isinstance(load.get("models"), dict) else (
                    {load["model"]: {}} if load.get("model") else {})  # fmt: skip
                row["nodes"][url] = {
                    "role": load.get("role", role), "t": round(time.monotonic() - self.t0, 3),
                    "state": node_state(load), "memory_used_bytes": load.get("memory_used_bytes"),
                    "memory_budget_bytes": load.get("memory_budget_bytes"), "rss_bytes": load.get("rss_bytes"),
                    "models": {m: [node_model_state(load, m), node_active(load, m),
                                   node_model(load, m).get("ready_s")] for m in models}}  # fmt: skip
            self.rows.append(row)
            tick += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def ready_nodes(self, model: str, at: float) -> set[str]:
        """Urls of the nodes that had `model` ready in the last sample at or before `at` (seconds since t0)."""
        last = None
        for row in self.rows:
            if row["t"] > at:
                break
            last = row
        return {u for u, n in (last or {"nodes": {}})["nodes"].items() if (n["models"].get(model) or [None])[0] == "ready"}

    def first(self, model: str, after: float, exclude: set[str], what: str) -> dict[str, float]:
        """Role -> first time (since t0) after `after` a node not in `exclude` had `model` ready
        (what="ready") or a request of it running (what="active")."""
        out: dict[str, float] = {}
        for row in self.rows:
            if row["t"] < after:
                continue
            for url, n in row["nodes"].items():
                st = n["models"].get(model)
                if url in exclude or st is None or n["role"] in out:
                    continue
                if (what == "ready" and st[0] == "ready") or (what == "active" and st[1] > 0):
                    out[n["role"]] = n["t"]
        return out

    def first_scale_up(self, model: str, after: float) -> tuple[float, str] | None:
        """(time since t0, "key: reason") of the first decision after `after` that asks `model` for more
        replicas than it had (or than was asked at `after`: a claim can land before the next sample)."""
        asked: dict[str, int] = {}
        for row in self.rows:
            for key, (want, cur, reason, _) in (row.get("decisions") or {}).items():
                if key.split("/")[0] != model or want is None:
                    continue
                if row["t"] < after:
                    asked[key] = want
                elif want > asked.get(key, want) or (cur is not None and want > cur):
                    return row["t"], f"{key}: {reason}"
        return None

    def compact(self, model: str | None = None, every_s: float = 0.5) -> list[dict]:
        """The rows thinned to one per `every_s`, nodes counted per role: ready (with `model`, or any),
        standby, runtimes (node processes answering)."""
        out, last = [], -1e9
        for row in self.rows:
            if row["t"] - last < every_s:
                continue
            last = row["t"]
            c: dict = {"t": row["t"], "queue_depth": row.get("queue_depth"), "decisions": row.get("decisions"),
                       "traffic": row.get("traffic")}  # fmt: skip
            for n in row["nodes"].values():
                r = n["role"]
                c[f"{r}_runtimes"] = c.get(f"{r}_runtimes", 0) + 1
                c[f"{r}_standby"] = c.get(f"{r}_standby", 0) + (n["state"] == "standby")
                ready = [m for m, v in n["models"].items() if v[0] == "ready" and (model is None or m == model)]
                c[f"{r}_ready"] = c.get(f"{r}_ready", 0) + bool(ready)
            out.append(c)
        return out


# --- /load readers (both shapes) ----------------------------------------------------------
def node_model(load: dict | None, model: str) -> dict:
    """The per-model part of a node's /load (the node-level fields on a one-model node)."""
    if not load:
        return {}
    models = load.get("models")
    if isinstance(models, dict):
        return models.get(model) or {}
    if load.get("model") in (model, None) or load.get("model_ref", "").split("@")[0] == model:
        return {**load, "state": "ready" if load.get("ready") else ("draining" if load.get("draining") else "loading")}
    return {}


def node_model_state(load: dict | None, model: str) -> str | None:
    """"loading" | "ready" | "draining" | "failed" for `model` on that node; None if it does not hold it."""
    return node_model(load, model).get("state")


def node_state(load: dict | None) -> str | None:
    """The runtime's own state: standby | loading | ready | draining."""
    if not load:
        return None
    return load.get("state") or ("ready" if load.get("ready") else "loading")


def node_active(load: dict | None, model: str) -> int:
    """Requests of `model` on that node now (active, else running + queued)."""
    m = node_model(load, model)
    if "active_requests" in m:
        return int(m["active_requests"] or 0)
    return int(m.get("running", 0) or 0) + int(m.get("queued", 0) or 0)


def status_nodes(status: dict | None) -> list[dict]:
    return list((status or {}).get("nodes") or [])


def count_ready(status: dict | None, model: str) -> dict[str, int]:
    """Role -> nodes whose last /load (as the gateway saw it) has `model` ready."""
    out: dict[str, int] = {}
    for n in status_nodes(status):
        if n.get("state") != "unhealthy" and node_model_state(n.get("load"), model) == "ready":
            out[n["role"]] = out.get(n["role"], 0) + 1
    return out


def count_standby(status: dict | None) -> dict[str, int]:
    """Role -> registered runtimes in standby (no model held)."""
    out: dict[str, int] = {}
    for n in status_nodes(status):
        if node_state(n.get("load")) == "standby" and n.get("state") != "unhealthy":
            out[n["role"]] = out.get(n["role"], 0) + 1
    return out
