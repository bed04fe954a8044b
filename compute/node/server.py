"""The node's internal HTTP API (FastAPI): what the gateway calls. See gateway/nodes.py for the protocol."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import decode as decode_role
from . import prefill as prefill_role
from .service import BadNodeRequest, NodeBusy, NodeService, new_sequence, parse, sampling_params

log = logging.getLogger("pdserve.node")
OPEN_PATHS = ("/health", "/ready")  # what a kubelet probes, without credentials (no state beyond ready/draining)


def create_app(svc: NodeService, injector) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_drive_sender(svc)) if svc.sender is not None else None
        yield
        if task:
            task.cancel()

    app = FastAPI(title="pdserve node", lifespan=lifespan)
    role = svc.config.role
    token = svc.config.internal_token.encode()

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            got = request.headers.get("authorization", "")
            got = got[7:].strip() if got.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(got.encode(), token):
                return JSONResponse({"detail": "missing or invalid internal token"}, status_code=401)
        return await call_next(request)

    def guard(fn):
        async def run(request: Request):
            if not injector.ready:
                return JSONResponse({"detail": "weights are still loading"}, status_code=503)
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                return JSONResponse({"detail": "body is not valid JSON"}, status_code=400)
            if not isinstance(body, dict):
                return JSONResponse({"detail": "body must be a JSON object"}, status_code=400)
            try:
                return await fn(body)
            except BadNodeRequest as e:
                return JSONResponse({"detail": str(e)}, status_code=400)
            except NodeBusy as e:
                return JSONResponse({"detail": str(e)}, status_code=503)

        return run

    async def generate(body: dict):
        svc.check_accepting()
        rid, prompt, params = parse(body)
        svc.check_tokens(prompt)
        q = await svc.add(rid, new_sequence(prompt, params, sampling_params(params)), "generate")
        return StreamingResponse(svc.relay(rid, q), media_type="application/x-ndjson")

    async def prefill(body: dict):
        return JSONResponse(await prefill_role.prefill(svc, body))

    async def decode(body: dict):
        rid, q = await decode_role.decode(svc, body)
        return StreamingResponse(svc.relay(rid, q), media_type="application/x-ndjson")

    if role in ("both", "prefill", "decode"):
        app.post("/internal/generate")(guard(generate))  # any node can serve a whole request
    if role == "prefill":
        app.post("/internal/prefill")(guard(prefill))
    if role == "decode":
        app.post("/internal/decode")(guard(decode))

    @app.post("/internal/abort")
    async def abort(request: Request):
        body = await request.json()
        return {"aborted": svc.abort(str(body.get("request_id", "")))}

    @app.post("/internal/drain")
    async def drain(timeout_s: float = 60.0):
        return {"drained": await svc.drain(timeout_s)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        p = injector.progress.as_dict()
        ok = injector.ready and not svc.draining
        return JSONResponse({"ready": ok, "draining": svc.draining, "progress": p}, status_code=200 if ok else 503)

    @app.get("/load")
    async def load():
        out = svc.load(injector.ready)
        out["progress"] = injector.progress.as_dict()
        return out

    @app.get("/metrics")
    async def metrics():
        svc.load(injector.ready)  # refresh gauges
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _drive_sender(svc: NodeService) -> None:
    """Poll held offers: drives NIXL notifications and hold deadlines (blocks come back on time)."""
    while True:
        await asyncio.sleep(0.005)
        for rid in list(svc.held):
            try:
                svc.sender.poll(rid)
            except KeyError:
                svc.held.pop(rid, None)
            except Exception:  # noqa: BLE001 - one bad offer must not stop the loop
                log.exception("polling KV offer %s", rid)
        svc.sender.held()
