"""The gateway's admin API (Bearer admin key; without one it is closed, 401, unless the gateway was started
with --open-admin): the node registry by hand, the status `pdserve status` prints, the autoscaler's report.

  GET    /admin/nodes          every registered node: role, state, models held, last /load; the refused URLs
  POST   /admin/nodes          {"url", "role", "source"?}: register a node, challenged at once: 403 naming why
                               when it fails the proof (compute/node/auth.py); proven: false while unreachable
  DELETE /admin/nodes?url=URL  deregister a node
  GET    /admin/status         the served models (per model: traffic as in /internal/status), the
                               nodes, admission, the autoscaler's last report, the local supervisor
  POST   /admin/autoscaler     publish a control-loop report
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api import protocol as p
from gateway.api.openapi import errors
from gateway.routes.internal import model_status, register


def admin_router(gw) -> APIRouter:
    router = APIRouter()
    admin_errors = errors(400, 401)

    @router.get("/admin/nodes", response_model=p.NodeList, responses=errors(401))
    async def list_nodes():
        return {"nodes": [n.as_dict() for n in gw.registry.nodes.values()], "refused": gw.registry.refused}

    @router.post("/admin/nodes", response_model=p.NodeAdded, responses=errors(400, 401, 403))
    async def add_node(body: p.NodeSpec):
        return await register(gw, body)

    @router.delete("/admin/nodes", response_model=p.NodeRemoved, responses=admin_errors)
    async def remove_node(url: str):
        return {"removed": gw.registry.remove(url)}

    @router.get("/admin/status", responses={200: {"model": p.AdminStatus}, **errors(401)})  # documented, not filtered
    async def status():
        return {"model": gw.config.model, "served": gw.models.names, "models": model_status(gw),
                "nodes": [n.as_dict() for n in gw.registry.nodes.values()], "refused": gw.registry.refused,
                "queue_depth": gw.admission.waiting, "running": gw.admission.running,
                "autoscaler": gw.autoscaler_status,
                "supervisor": gw.supervisor() if gw.supervisor else None}  # fmt: skip

    @router.post("/admin/autoscaler", response_model=p.Ok, responses=admin_errors)
    async def autoscaler_report(body: dict):
        gw.autoscaler_status = body
        return {"ok": True}

    return router
