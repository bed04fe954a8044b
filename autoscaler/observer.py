"""The control loop's eyes and voice: gateway status in, RoleLoad out; reports back to the gateway.

Observation (what the loop reads every tick):
 1. a status snapshot — the gateway's ``GET /internal/status`` (gateway/routes/internal.py), over HTTP
    from `pdserve autoscale`, or the same snapshot taken in-process by `pdserve up --autoscale`;
    with several gateway replicas, their snapshots are merged (queues add up, the p99 wait is
    the worst, nodes are the union by URL);
 2. ``loads_from_status`` turns it into {(model, role): RoleLoad}: per model, queue depth,
    held requests, p99 queue wait / TTFT / TPOT and idle time from the gateway
    (``status.models``, typed in gateway/api/status.py); queued prompt tokens, running and queued streams, KV use and the
    measured capacity from the nodes holding that model (``load.models[model]``), summed over
    those that answer their health checks. The loop then overlays the replica counts from the
    actuator (the truth about what runs) and calls the pure policy.

Publication: after every tick the loop's report (decision and why, what was asked, error,
the nodes per key; keys written "model/role") goes to ``POST /internal/autoscaler`` of every
gateway — what `pdserve status` shows. `GatewayClient` also registers the nodes a local actuator starts
(``POST /internal/nodes``, ``…/draining``, ``DELETE``), which is how a separate
`pdserve autoscale --actuator local` feeds a separate `pdserve gateway`; a registration lost (the gateway
unreachable when the node became ready, or restarted since) is sent again once a snapshot shows the node
missing, and a node the gateway still lists as the autoscaler's after it ended (its deregistration lost) is
deregistered (``reconcile``): a partition between the two never leaves a running node unserved, nor a dead one
listed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import httpx
import msgspec

from compute.node.auth import Prover, SignedAuth
from gateway.api.status import GatewayStatus, ModelTraffic, NodeEntry
from gateway.api.status import read as read_status

from .actuator import NodeInfo, TemporaryActuatorError
from .config import ROLES, AutoscalerConfig
from .loop import ControlLoop, TickReport
from .policy import Key, RoleLoad, key_str

log = logging.getLogger("pdserve.autoscaler")

Status = Callable[[], "GatewayStatus | Mapping"]


HOLDING = ("loading", "ready")  # model states that make a node a replica of (model, its role)
_SUMMED = ("queue_depth", "held", "running", "requests", "recent_requests")  # per-model gateway counts that add up over gateways
_WORST = ("queue_wait_p99_s", "ttft_p99_s", "tpot_p99_s")  # per-model p99s: the worst gateway's
RATES = ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s")  # per-model arrival rates: add up


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


@dataclasses.dataclass(slots=True)
class _Replicas:
    """One (model, role)'s nodes, summed as ``loads_from_status`` reads them."""

    replicas: int = 0
    ready: int = 0
    starting: int = 0
    queued_prompt_tokens: int = 0
    running: int = 0
    queued: int = 0
    used: int = 0
    total: int = 0
    streams: list = dataclasses.field(default_factory=list)
    tps: list = dataclasses.field(default_factory=list)
    dtps: list = dataclasses.field(default_factory=list)


def loads_from_status(status: GatewayStatus | Mapping, roles: Sequence[str] = ROLES) -> dict[Key, RoleLoad]:
    """{(model, role): RoleLoad} from one gateway status snapshot (gateway/api/status.py, or its JSON data).

    Keys: every model in ``status.models`` and every model a node holds, times `roles`. A node is
    a replica of (m, its role) while ``load.models[m].state`` is loading or ready: counted ready or
    starting by that state; its load is summed only while it answers its health checks (an
    unhealthy node is a replica with a stale load) and not while it drains. capacity_streams and
    prefill_tokens_per_s: the mean over the ready replicas that have measured them.
    """
    status = read_status(status)
    acc: dict[Key, _Replicas] = {}
    for n in status.nodes:
        if n.role not in roles:
            continue
        for model, e in n.load.models.items():
            a = acc.setdefault((model, n.role), _Replicas())
            if e.state not in HOLDING or n.state == "draining":
                continue
            a.replicas += 1
            if n.state == "unhealthy":
                continue
            if e.state == "ready":
                a.ready += 1
                a.streams.append(e.capacity.get("max_streams"))
                a.tps.append(e.capacity.get("prefill_tokens_per_s"))
                a.dtps.append(decode_tokens_at_slo(e.capacity))
            else:
                a.starting += 1
            a.queued_prompt_tokens += e.queued_prompt_tokens
            a.running += e.running
            a.queued += e.queued
            a.used += e.kv_blocks_used
            a.total += e.kv_blocks_total
    out = {}
    for model in [*status.models, *sorted({m for m, _ in acc} - set(status.models))]:
        g = status.models.get(model) or ModelTraffic()
        for role in roles:
            a = acc.get((model, role))
            out[(model, role)] = RoleLoad(
                model=model, queue_depth=g.queue_depth, held=g.held, queue_wait_p99_s=g.queue_wait_p99_s,
                ttft_p99_s=g.ttft_p99_s, tpot_p99_s=g.tpot_p99_s, idle_s=g.idle_s,
                **{f: getattr(g, f) for f in RATES}, recent_requests=g.recent_requests,
                **({} if a is None else {
                    "replicas": a.replicas, "ready": a.ready, "starting": a.starting,
                    "queued_prompt_tokens": a.queued_prompt_tokens, "running_streams": a.running,
                    "node_queued": a.queued, "kv_utilisation": a.used / a.total if a.total else 0.0,
                    "capacity_streams": _mean(a.streams), "prefill_tokens_per_s": _mean(a.tps),
                    "decode_tokens_per_s": _mean(a.dtps)}),
            )  # fmt: skip
    return out


def merge_status(snapshots: Sequence[GatewayStatus | Mapping]) -> GatewayStatus:
    """One snapshot from several gateway replicas: queues add up, the worst p99, nodes by URL (a healthy
    gateway's view of a node over an unhealthy one's).

    Per model: counts and arrival rates add up, p99s are the worst, idle_s the least idle, last_request_t the latest.
    """
    snaps = [read_status(s) for s in snapshots]
    nodes: dict[str, NodeEntry] = {}
    for s in snaps:
        for n in s.nodes:
            if n.url not in nodes or nodes[n.url].state == "unhealthy":
                nodes[n.url] = n
    models: dict[str, ModelTraffic] = {}
    for s in snaps:
        for name, e in s.models.items():
            o = models.get(name)
            if o is None:
                models[name] = msgspec.structs.replace(e)
                continue
            for f in (*_SUMMED, *RATES):
                setattr(o, f, getattr(o, f) + getattr(e, f))
            for f in _WORST:
                setattr(o, f, max(getattr(o, f), getattr(e, f)))
            o.idle_s = min(o.idle_s, e.idle_s)
            if e.last_request_t is not None:
                o.last_request_t = max(o.last_request_t or 0.0, e.last_request_t)
    return GatewayStatus(queue_depth=sum(s.queue_depth for s in snaps), running=sum(s.running for s in snaps),
                         queue_wait_p99_s=max((s.queue_wait_p99_s for s in snaps), default=0.0),
                         model=snaps[0].model if snaps else None, models=models, nodes=list(nodes.values()),
                         gateways=len(snaps))  # fmt: skip


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


RESEND_S = 10.0  # GatewayClient.reconcile: the least time between two sends for one node to one gateway


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
        self._prover = Prover(token, timeout_s=min(timeout_s, 2.0))  # a gateway proves the token before it is used
        self._listed: dict[str, dict[str, str]] = {}  # gateway -> {node URL: its source} in its last snapshot
        self._resent: dict[tuple[str, str], float] = {}  # (gateway, node) -> when its registration was last sent again

    def status(self) -> GatewayStatus:
        """The merged snapshot of every gateway that proves the internal token (one that does not is left out
        and sent nothing: a pod wearing the gateway's labels, or whatever now answers on a dead gateway's
        address); TemporaryActuatorError if none does or a proven one cannot be read."""
        urls = [u.rstrip("/") for u in self._urls()]
        if not urls:
            raise TemporaryActuatorError("no gateway to observe (no ready gateway endpoint)")
        self.urls = [u for u in urls if self._prover.proven(u)]
        for url in set(urls) - set(self.urls):
            log.warning("%s did not prove the internal token: not a gateway of this deployment, not observed", url)
        if not self.urls:
            raise TemporaryActuatorError(f"no gateway proved the internal token (of {', '.join(urls)})")
        snaps = []
        for url in self.urls:
            try:
                r = self._http.get(url + "/internal/status")
                r.raise_for_status()
                raw = r.json()
                snaps.append(read_status(raw))
                self._listed[url] = {str(n.get("url", "")).rstrip("/"): n.get("source") or ""
                                     for n in raw.get("nodes") or []}  # fmt: skip
            except (httpx.HTTPError, ValueError) as e:
                self._prover.forget(url)  # challenged again before its next use
                raise TemporaryActuatorError(f"cannot observe the gateway at {url}: {e}") from None
        return snaps[0] if len(snaps) == 1 else merge_status(snaps)

    def publish(self, body: dict) -> None:
        for url in self.urls:
            self._post(url + "/internal/autoscaler", body)

    def register(self, node: NodeInfo) -> None:
        for url in self.urls:
            self._register(url, node)

    def _register(self, url: str, node: NodeInfo) -> None:
        self._post(url + "/internal/nodes", {"url": node.url, "role": node.role, "source": "autoscaler"})

    def reconcile(self, nodes: Iterable[NodeInfo], now: float | None = None) -> list[str]:
        """Each gateway's last snapshot against ``nodes``, every node this autoscaler runs: a ready one it does not
        list is registered again, one it lists as the autoscaler's that is not among ``nodes`` is deregistered (at
        most once per ``RESEND_S`` per node and gateway: a node a gateway refuses is not asked about every tick);
        -> the URLs sent."""
        now = time.monotonic() if now is None else now
        self._resent = {k: t for k, t in self._resent.items() if now - t < RESEND_S}
        ours = {n.url.rstrip("/"): n for n in nodes}
        sent = []
        for url in self.urls:
            listed = self._listed.get(url)
            if listed is None:
                continue
            missing = [u for u, n in ours.items() if u not in listed and n.ready and n.state != "draining"]
            gone = [u for u, source in listed.items() if source == "autoscaler" and u not in ours]
            for node_url in missing + gone:
                if now - self._resent.get((url, node_url), -RESEND_S) < RESEND_S:
                    continue
                self._resent[(url, node_url)] = now
                sent.append(node_url)
                node = ours.get(node_url)
                if node is None:
                    log.warning("node %s ended but the gateway %s still lists it: deregistering it", node_url, url)
                    self.deregister(NodeInfo(role="", url=node_url, ready=False))
                else:
                    log.warning("node %s is not registered with the gateway %s (its registration was lost): "
                                "registering it again", node_url, url)  # fmt: skip
                    self._register(url, node)
        return sent

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
        self._prover.close()


def control_loop(config: AutoscalerConfig, status: Status, publish: Callable[[dict], None], actuator,
                 kind: str, roles: Sequence[str] = ROLES) -> ControlLoop:  # fmt: skip
    """A ControlLoop (not started) observing `status()` and publishing each tick's report with `publish`."""
    def pub(report: TickReport, nodes: Mapping[Key, list[NodeInfo]]) -> None:
        publish(report_body(report, nodes, kind))

    return ControlLoop(config, observe=GatewayObserver(status, roles), actuator=actuator, publish=pub)
