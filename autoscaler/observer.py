"""The control loop's eyes and voice: gateway status in, RoleLoad out; reports back to the gateway.

Observation (what the loop reads every tick):
 1. a status snapshot — the gateway's ``GET /internal/status`` (gateway/internal.py), over HTTP
    from `pdserve autoscale`, or the same snapshot taken in-process by `pdserve up --autoscale`;
    with several gateway replicas, their snapshots are merged (queues add up, the p99 wait is
    the worst, nodes are the union by URL);
 2. ``loads_from_status`` turns it into {role: RoleLoad}: queue depth and p99 wait from the
    gateway, queued prompt tokens, running streams and KV use summed over the role's nodes
    that answer their health checks. The loop then overlays the replica counts from the
    actuator (the truth about what runs) and calls the pure policy.

Publication: after every tick the loop's report (decision and why, what was asked, error,
the nodes per role) goes to ``POST /internal/autoscaler`` of every gateway — what
`pdserve status` shows. `GatewayClient` also registers the nodes a local actuator starts
(``POST /internal/nodes``, ``…/draining``, ``DELETE``), which is how a separate
`pdserve autoscale --actuator local` feeds a separate `pdserve gateway`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from .actuator import NodeInfo, TemporaryActuatorError
from .config import ROLES, AutoscalerConfig
from .loop import ControlLoop, TickReport
from .policy import RoleLoad

log = logging.getLogger("pdserve.autoscaler")

Status = Callable[[], Mapping]


def loads_from_status(status: Mapping, roles: Sequence[str] = ROLES) -> dict[str, RoleLoad]:
    """{role: RoleLoad} from one gateway status snapshot (see gateway/internal.py `snapshot`)."""
    nodes = status.get("nodes", [])
    out = {}
    for role in roles:
        mine = [n for n in nodes if n.get("role") == role]
        ld = [n.get("load") or {} for n in mine if n.get("state") != "unhealthy"]
        used = sum(x.get("kv_blocks_used", 0) for x in ld)
        total = sum(x.get("kv_blocks_total", 0) for x in ld) or 1
        out[role] = RoleLoad(
            replicas=len(mine), ready=len(ld), starting=0, queue_depth=int(status.get("queue_depth", 0)),
            queue_wait_p99_s=float(status.get("queue_wait_p99_s", 0.0)),
            queued_prompt_tokens=sum(x.get("queued_prompt_tokens", 0) for x in ld),
            running_streams=sum(x.get("running", 0) for x in ld), kv_utilisation=used / total,
        )  # fmt: skip
    return out


def merge_status(snapshots: Sequence[Mapping]) -> dict:
    """One snapshot from several gateway replicas: queues add up, the worst p99, nodes by URL."""
    nodes: dict[str, Mapping] = {}
    for s in snapshots:
        for n in s.get("nodes", []):
            if n.get("url") not in nodes or nodes[n["url"]].get("state") == "unhealthy":
                nodes[n.get("url")] = n
    return {"queue_depth": sum(int(s.get("queue_depth", 0)) for s in snapshots),
            "running": sum(int(s.get("running", 0)) for s in snapshots),
            "queue_wait_p99_s": max((float(s.get("queue_wait_p99_s", 0.0)) for s in snapshots), default=0.0),
            "nodes": list(nodes.values()), "gateways": len(snapshots)}  # fmt: skip


class GatewayObserver:
    """`observe()` for the ControlLoop: a status snapshot -> {role: RoleLoad}."""

    def __init__(self, status: Status, roles: Sequence[str] = ROLES):
        self.status, self.roles = status, tuple(roles)

    def __call__(self) -> dict[str, RoleLoad]:
        return loads_from_status(self.status(), self.roles)


def report_body(report: TickReport, nodes: Mapping[str, list[NodeInfo]], actuator: str) -> dict:
    """A tick as the gateway stores it for `pdserve status` (JSON)."""
    d = report.decision
    return {**report.to_dict(), "reason": d.reason if d else "", "actuator": actuator, "published": time.time(),
            "nodes": {r: [dataclasses.asdict(n) for n in ns] for r, ns in nodes.items()}}  # fmt: skip


class GatewayClient:
    """The internal API of one or more gateways, with the internal token (see gateway/internal.py)."""

    def __init__(self, urls: Sequence[str] | Callable[[], Sequence[str]], token: str, timeout_s: float = 5.0):
        """`urls`: the gateways, or a function giving them (e.g. every ready gateway pod), asked once per status()."""
        if not urls:
            raise ValueError("no gateway URL given")
        if not token:
            raise ValueError("no internal token: set $PDSERVE_INTERNAL_TOKEN (the gateway's)")
        fixed = [] if callable(urls) else [u.rstrip("/") for u in urls]
        self._urls = urls if callable(urls) else (lambda: fixed)
        self.urls: list[str] = fixed  # as of the last status()
        self._http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

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
    if "both" in roles:
        raise ValueError("autoscaling sizes prefill and decode independently: use --prefill N --decode M")

    def pub(report: TickReport, nodes: Mapping[str, list[NodeInfo]]) -> None:
        publish(report_body(report, nodes, kind))

    return ControlLoop(config, observe=GatewayObserver(status, roles), actuator=actuator, publish=pub)
