"""The gateway's own health: ``/health`` (the process answers), ``/ready`` (a route to a node exists: 503 if
not), ``/metrics`` (Prometheus) and ``/load`` (its admission queue, as the autoscaler reads it)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api import protocol as p


def health_router(gw) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=p.Health)
    async def health():
        return {"status": "ok"}

    @router.get("/ready", responses={200: {"model": p.Ready},
                                     503: {"model": p.Ready, "description": "no route to a node"}})  # fmt: skip
    async def ready():
        ok = gw.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/load", response_model=p.Load)
    async def load():
        return {"queue_depth": gw.admission.waiting, "running": gw.admission.running,
                "queue_wait_p99_s": gw.admission.wait_p99(), "drain_rate_per_s": gw.admission.drain_rate()}  # fmt: skip

    return router
