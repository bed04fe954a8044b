"""The control loop's eyes and voice: gateway status in, RoleLoad out; reports back to the gateway.

Observation (what the loop reads every tick):
 1. a status snapshot — the gateway's ``GET /internal/status`` (gateway/routes/internal.py), over HTTP
    from `pdserve autoscale`, or the same snapshot taken in-process by `pdserve up --autoscale`;
    with several gateway replicas, their snapshots are merged (queues add up, the p99 wait is
    the worst, nodes are the union by URL);
 2. ``loads_from_status`` turns it into {(model, role): RoleLoad}: per model, queue depth,
    held requests, p99 queue wait / TTFT / TPOT and idle time from the gateway
    (``status["models"]``); queued prompt tokens, running and queued streams, KV use and the
    measured capacity from the nodes holding that model (``load.models[model]``), summed over
    those that answer their health checks. The loop then overlays the replica counts from the
    actuator (the truth about what runs) and calls the pure policy.

Publication: after every tick the loop's report (decision and why, what was asked, error,
the nodes per key; keys written "model/role") goes to ``POST /internal/autoscaler`` of every
gateway — what `pdserve status` shows. `GatewayClient` also registers the nodes a local actuator starts
(``POST /internal/nodes``, ``…/draining``, ``DELETE``), which is how a separate
`pdserve autoscale --actuator local` feeds a separate `pdserve gateway`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from compute.node.auth import SignedAuth

from .actuator import NodeInfo, TemporaryActuatorError
from .config import ROLES, AutoscalerConfig
from .loop import ControlLoop, TickReport
from .policy import Key, RoleLoad, key_str

log = logging.getLogger("pdserve.autoscaler")

Status = Callable[[], Mapping]


HOLDING = ("loading", "ready")  # model states that make a node a replica of (model, its role)
_SUMMED = ("queue_depth", "held", "running", "requests", "recent_requests")  # per-model gateway counts that add up over gateways
_WORST = ("queue_wait_p99_s", "ttft_p99_s", "tpot_p99_s")  # per-model p99s: the worst gateway's
RATES = ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s")  # per-model arrival rates: add up


def held_models(load: Mapping, default: str | None = None) -> dict[str, tuple[Mapping, str]]:
    """{model: (its /load entry, its state)} that one node's /load reports.

    A node from before per-model reports (no "models") holds its top-level "model" — or `default` (an old
    gateway's one model) when its load names none — in the state its top-level flags give.
    """
    models = load.get("models")
    if isinstance(models, Mapping):
        return {m: (e or {}, str((e or {}).get("state", ""))) for m, e in models.items()}
    name = load.get("model") or default
    if not name:
        return {}  # a standby runtime: it holds nothing
    return {name: (load, "draining" if load.get("draining") else ("ready" if load.get("ready") else "loading"))}


def _mean(xs: list) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
    return sum(vals) / len(vals) if vals else None


def decode_tokens_at_slo(cap: Mapping) -> float | None:
    """Tokens/s one decode replica gives at the SLO batch: max_streams / step time at max_streams (the node's
    fitted line), else the throughput it measured at whatever batches it ran (lower: smaller batches)."""
    step, n = cap.get("decode_step_s"), cap.get("max_streams")
    if isinstance(step, Mapping) and isinstance(n, (int, float)) and n > 0:
        t = float(step.get("a", 0.0) or 0.0) + float(step.get("b", 0.0) or 0.0) * n
        if t > 0:
            return n / t
    v = cap.get("decode_tokens_per_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def loads_from_status(status: Mapping, roles: Sequence[str] = ROLES) -> dict[Key, RoleLoad]:
    """{(model, role): RoleLoad} from one gateway status snapshot (gateway/routes/internal.py `snapshot`).

    Keys: every model in ``status["models"]`` and every model a node holds, times `roles`. A node is
    a replica of (m, its role) while ``load.models[m].state`` is loading or ready: counted ready or
    starting by that state; its load is summed only while it answers its health checks (an
    unhealthy node is a replica with a stale load) and not while it drains. capacity_streams and
    prefill_tokens_per_s: the mean over the ready replicas that have measured them.
    """
    per_model = status.get("models")
    default = None
    if not isinstance(per_model, Mapping):  # a gateway from before per-model reports: one model, its queue at the top
        default = status.get("model") or None
        per_model = {default: {"queue_depth": status.get("queue_depth", 0),
                               "queue_wait_p99_s": status.get("queue_wait_p99_s", 0.0)}} if default else {}  # fmt: skip
    acc: dict[Key, dict] = {}
    for n in status.get("nodes", []):
        role = n.get("role")
        if role not in roles:
            continue
        for model, (e, state) in held_models(n.get("load") or {}, default).items():
            a = acc.setdefault((model, role), {"replicas": 0, "ready": 0, "starting": 0, "queued_prompt_tokens": 0,
                                               "running": 0, "queued": 0, "used": 0, "total": 0, "streams": [],
                                               "tps": [], "dtps": []})  # fmt: skip
            if state not in HOLDING or n.get("state") == "draining":
                continue
            a["replicas"] += 1
            if n.get("state") == "unhealthy":
                continue
            a["ready" if state == "ready" else "starting"] += 1
            for f in ("queued_prompt_tokens", "running", "queued"):
                a[f] += int(e.get(f, 0) or 0)
            a["used"] += int(e.get("kv_blocks_used", 0) or 0)
            a["total"] += int(e.get("kv_blocks_total", 0) or 0)
            if state == "ready":
                cap = e.get("capacity") or {}
                a["streams"].append(cap.get("max_streams"))
                a["tps"].append(cap.get("prefill_tokens_per_s"))
                a["dtps"].append(decode_tokens_at_slo(cap))
    out = {}
    for model in [*per_model, *sorted({m for m, _ in acc} - set(per_model))]:
        g = per_model.get(model) or {}
        for role in roles:
            a = acc.get((model, role))
            out[(model, role)] = RoleLoad(
                model=model, queue_depth=int(g.get("queue_depth", 0)), held=int(g.get("held", 0)),
                queue_wait_p99_s=float(g.get("queue_wait_p99_s", 0.0)), ttft_p99_s=float(g.get("ttft_p99_s", 0.0)),
                tpot_p99_s=float(g.get("tpot_p99_s", 0.0)), idle_s=float(g.get("idle_s", 0.0) or 0.0),
                **{f: float(g.get(f, 0.0) or 0.0) for f in RATES}, recent_requests=int(g.get("recent_requests", 0) or 0),
                **({} if a is None else {
                    "replicas": a["replicas"], "ready": a["ready"], "starting": a["starting"],
                    "queued_prompt_tokens": a["queued_prompt_tokens"], "running_streams": a["running"],
                    "node_queued": a["queued"], "kv_utilisation": a["used"] / a["total"] if a["total"] else 0.0,
                    "capacity_streams": _mean(a["streams"]), "prefill_tokens_per_s": _mean(a["tps"]),
                    "decode_tokens_per_s": _mean(a["dtps"])}),
            )  # fmt: skip
    return out


def merge_status(snapshots: Sequence[Mapping]) -> dict:
    """One snapshot from several gateway replicas: queues add up, the worst p99, nodes by URL.

    Per model: counts and arrival rates add up, p99s are the worst, idle_s the least idle, last_request_t the latest.
    """
    nodes: dict[str, Mapping] = {}
    for s in snapshots:
        for n in s.get("nodes", []):
            if n.get("url") not in nodes or nodes[n["url"]].get("state") == "unhealthy":
                nodes[n.get("url")] = n
    out = {"queue_depth": sum(int(s.get("queue_depth", 0)) for s in snapshots),
           "running": sum(int(s.get("running", 0)) for s in snapshots),
           "queue_wait_p99_s": max((float(s.get("queue_wait_p99_s", 0.0)) for s in snapshots), default=0.0),
           "nodes": list(nodes.values()), "gateways": len(snapshots)}  # fmt: skip
    if snapshots and "model" in snapshots[0]:
        out["model"] = snapshots[0]["model"]
    if any(isinstance(s.get("models"), Mapping) for s in snapshots):
        out["models"] = _merge_models([s.get("models") or {} for s in snapshots])
    return out


def _merge_models(per_gateway: Sequence[Mapping]) -> dict:
    out: dict[str, dict] = {}
    for models in per_gateway:
        for name, e in models.items():
            o = out.setdefault(name, {"last_request_t": None})
            for f in _SUMMED:
                o[f] = o.get(f, 0) + int(e.get(f, 0))
            for f in _WORST:
                o[f] = max(o.get(f, 0.0), float(e.get(f, 0.0)))
            for f in RATES:
                o[f] = o.get(f, 0.0) + float(e.get(f, 0.0) or 0.0)
            if "idle_s" in e:
                o["idle_s"] = min(o.get("idle_s", math.inf), float(e["idle_s"]))
            if e.get("last_request_t") is not None:
                o["last_request_t"] = max(o["last_request_t"] or 0.0, float(e["last_request_t"]))
    return out


class GatewayObserver:
    """`observe()` for the ControlLoop: a status snapshot -> {(model, role): RoleLoad}."""

    def __init__(self, status: Status, roles: Sequence[str] = ROLES):
        self.status, self.roles = status, tuple(roles)

    def __call__(self) -> dict[Key, RoleLoad]:
        return loads_from_status(self.status(), self.roles)


def report_body(report: TickReport, nodes: Mapping[Key, list[NodeInfo]], actuator: str) -> dict:
    """A tick as the gateway stores it for `pdserve status` (JSON; keys written "model/role")."""
    d = report.decision
    return {**report.to_dict(), "reason": d.reason if d else "", "actuator": actuator, "published": time.time(),
            "nodes": {key_str(k): [dataclasses.asdict(n) for n in ns] for k, ns in nodes.items()}}  # fmt: skip


class GatewayClient:
    """The internal API of one or more gateways, with the internal token (see gateway/routes/internal.py)."""

    def __init__(self, urls: Sequence[str] | Callable[[], Sequence[str]], token: str, timeout_s: float = 5.0):
        """`urls`: the gateways, or a function giving them (e.g. every ready gateway pod), asked once per status()."""
        if not urls:
            raise ValueError("no gateway URL given")
        if not token:
            raise ValueError("no internal token: set $PDSERVE_INTERNAL_TOKEN (the gateway's)")
        fixed = [] if callable(urls) else [u.rstrip("/") for u in urls]
        self._urls = urls if callable(urls) else (lambda: fixed)
        self.urls: list[str] = fixed  # as of the last status()
        self._http = httpx.Client(auth=SignedAuth(token), timeout=timeout_s)  # signed requests: the token never sent

    def status(self) -> dict:
        """The merged snapshot of every gateway; TemporaryActuatorError if any cannot be read."""
        self.urls = [u.rstrip("/") for u in self._urls()]
        if not self.urls:
            raise TemporaryActuatorError("no gateway to observe (no ready gateway endpoint)")
        snaps = []
        for url in self.urls:
            try:
                r = self._http.get(url + "/internal/status")
                r.raise_for_status()
                snaps.append(r.json())
            except (httpx.HTTPError, ValueError) as e:
                raise TemporaryActuatorError(f"cannot observe the gateway at {url}: {e}") from None
        return snaps[0] if len(snaps) == 1 else merge_status(snaps)

    def publish(self, body: dict) -> None:
        for url in self.urls:
            self._post(url + "/internal/autoscaler", body)

    def register(self, node: NodeInfo) -> None:
        for url in self.urls:
            self._post(url + "/internal/nodes", {"url": node.url, "role": node.role, "source": "autoscaler"})

    def draining(self, node: NodeInfo) -> None:
        for url in self.urls:
            self._post(url + "/internal/nodes/draining", {"url": node.url})

    def deregister(self, node: NodeInfo) -> None:
        for url in self.urls:
            try:
                self._http.delete(url + "/internal/nodes", params={"url": node.url}).raise_for_status()
            except httpx.HTTPError as e:
                log.warning("deregister %s at %s failed: %s", node.url, url, e)

    def _post(self, url: str, body: dict) -> None:
        try:
            self._http.post(url, json=body).raise_for_status()
        except httpx.HTTPError as e:
            log.warning("POST %s failed: %s", url, e)

    def close(self) -> None:
        self._http.close()


def control_loop(config: AutoscalerConfig, status: Status, publish: Callable[[dict], None], actuator,
                 kind: str, roles: Sequence[str] = ROLES) -> ControlLoop:  # fmt: skip
    """A ControlLoop (not started) observing `status()` and publishing each tick's report with `publish`."""
    def pub(report: TickReport, nodes: Mapping[Key, list[NodeInfo]]) -> None:
        publish(report_body(report, nodes, kind))

    return ControlLoop(config, observe=GatewayObserver(status, roles), actuator=actuator, publish=pub)
