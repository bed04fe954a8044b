"""The gateway's internal API: what the autoscaler (and the local actuator) read and write.

Every route takes only requests signed with the internal token (compute/node/auth.py: the token is
never sent), as the nodes' routes do; a gateway without one refuses them all (401: ``SignedOnly``,
the app's middleware for /internal/*, beside the /v1 and /admin keys). They are left out of /openapi.json: the public
contract is /v1.

  GET    /internal/status           snapshot(): queue depth, running, p99 queue wait, the node
                                    registry (role, state, models, last /load of each node), the
                                    last published autoscaler report, and per model ("models":
                                    model_status) — the autoscaler's observation
  POST   /internal/autoscaler       publish a control-loop report (what `pdserve status` shows)
  POST   /internal/nodes            {"url", "role", "source"?}: register a node (checked at once)
  POST   /internal/nodes/draining   {"url"}: route nothing new to it (it is about to drain)
  DELETE /internal/nodes?url=URL    deregister a node
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, HTTPException, Response

from gateway.api.protocol import InternalNodeSpec, NodeSpec
from gateway.api.status import GatewayStatus, ModelTraffic, NodeEntry


def snapshot(gw) -> GatewayStatus:
    """What the gateway knows about load, now. Safe to call from another thread (copies the registry)."""
    nodes = [NodeEntry(**n.entry()) for n in list(gw.registry.nodes.values())]
    return GatewayStatus(
        t=time.time(), model=gw.config.model, queue_depth=gw.admission.waiting, running=gw.admission.running,
        queue_wait_p99_s=gw.admission.wait_p99(), held=gw.activator.held_total(), served=list(gw.models.names),
        models={m: ModelTraffic(**t) for m, t in model_status(gw).items()}, nodes=nodes,
        autoscaler=gw.autoscaler_status,
        prefix_index=gw.registry.index.summary() if gw.registry.index is not None else None)  # fmt: skip


def model_status(gw) -> dict[str, dict]:
    """Per model — every served one, and any other a request was made or held for: queue_depth
    (waiting for admission + held), held, running, the p99s of queue wait, TTFT and TPOT over the
    last minute, requests since start, last_request_t, idle_s, and the arrival rates over the last
    1-2 s: requests_per_s, prompt_tokens_per_s, output_tokens_per_s, recent_requests (the
    autoscaler's demand signal; see gateway.admission.traffic)."""
    held = dict(gw.activator.held)
    names = list(dict.fromkeys([*gw.models.names, *list(gw.traffic.models), *held]))
    return {m: gw.traffic.snapshot(m, held.get(m, 0)) for m in names if m}


async def register(gw, body: NodeSpec) -> dict:
    """Register a node and challenge it now (the others keep their poll): 403 naming why it failed the proof."""
    gw.registry.add(body.url, body.role, source=body.source)
    why = await gw.registry.refresh(body.url)
    if why is not None:
        raise HTTPException(403, f"node {body.url} refused: {why}")
    n = gw.registry.nodes.get(body.url.rstrip("/"))
    return {"added": body.url, "proven": bool(n and n.proven)}


def internal_router(gw) -> APIRouter:
    router = APIRouter()

    @router.get("/internal/status", include_in_schema=False)
    async def status():
        return Response(msgspec.json.encode(snapshot(gw)), media_type="application/json")

    @router.post("/internal/autoscaler", include_in_schema=False)
    async def autoscaler(body: dict):
        gw.autoscaler_status = {**body, "received": time.time()}
        return {"ok": True}

    @router.post("/internal/nodes", include_in_schema=False)
    async def add(body: InternalNodeSpec):  # checked as /admin/nodes' body is: 400 with the message, 403 unproven
        return await register(gw, body)

    @router.post("/internal/nodes/draining", include_in_schema=False)
    async def draining(body: dict):
        url = body.get("url")
        if not isinstance(url, str):
            raise HTTPException(400, "body needs url")
        gw.registry.mark_draining(url)
        return {"draining": url.rstrip("/")}

    @router.delete("/internal/nodes", include_in_schema=False)
    async def remove(url: str):
        return {"removed": gw.registry.remove(url)}

    return router
