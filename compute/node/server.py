"""The node's internal HTTP API (FastAPI): what the gateway and the autoscaler call.

Requests (``/internal/generate|prefill|decode``) carry ``"model"`` (absent: the node's only model)
and go to that model's ``NodeService``; a model not held or not ready here -> 503 (the gateway tries
elsewhere). Models are loaded and unloaded with ``/internal/models/load|unload`` (``models.ModelHost``).
See gateway/nodes.py for the request protocol and issue 12's contract A for the shapes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import auth
from . import decode as decode_role
from . import prefill as prefill_role
from .metrics import host_registry
from .models import ModelHost, ModelNotHeld, ModelUnknown
from .service import BadNodeRequest, NodeBusy, new_sequence, parse, sampling_params

log = logging.getLogger("pdserve.node")
# without credentials: what a kubelet probes (no state beyond ready/draining) and what Prometheus scrapes, open as
# vLLM's /metrics is (counts and timings per model; no secret, prompt or token: compute/node/metrics.py)
OPEN_PATHS = ("/health", "/ready", "/metrics", "/prove")  # /prove: a challenge, answered only with a proof


async def _json_object(request: Request) -> dict | None:
    """The body as a JSON object; None if it is not one."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def create_app(host: ModelHost) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_drive_senders(host)) if host.cfg.role == "prefill" else None
        yield
        if task:
            task.cancel()

    app = FastAPI(title="pdserve node", lifespan=lifespan)
    role = host.cfg.role
    cfg = host.cfg
    me = auth.Identity(cfg.host, cfg.port, cfg.advertise_url)
    app.add_middleware(auth.SignedOnly, token=cfg.internal_token, protected=lambda path: path not in OPEN_PATHS)

    @app.post("/prove")
    async def prove(request: Request):
        """The challenge the gateway sends before it registers this node (compute/node/auth.py)."""
        body = await _json_object(request)
        nonce, url = (body.get("nonce"), body.get("url")) if isinstance(body, dict) else (None, None)
        if not (isinstance(nonce, str) and 16 <= len(nonce) <= 128 and isinstance(url, str) and len(url) <= 2048):
            return JSONResponse({"detail": "want {\"nonce\": 16-128 characters, \"url\": this node's URL}"},
                                status_code=400)  # fmt: skip
        if not me.names(url):
            return JSONResponse({"detail": f"{url[:200]!r} does not name this node"}, status_code=403)
        return {"proof": auth.prove(cfg.internal_token, nonce, url)}

    def guard(fn):
        async def run(request: Request):
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
            except (ModelUnknown, ModelNotHeld) as e:
                return JSONResponse({"detail": str(e)}, status_code=404)
            except NodeBusy as e:
                return JSONResponse({"detail": str(e)}, status_code=503)

        return run

    async def generate(body: dict):
        svc = host.service(body)
        svc.check_accepting()
        rid, prompt, params = parse(body)
        svc.check_tokens(prompt)
        q = await svc.add(rid, new_sequence(prompt, params, sampling_params(params), svc.grammars), "generate")
        return StreamingResponse(svc.relay(rid, q), media_type="application/x-ndjson")

    async def prefill(body: dict):
        return JSONResponse(await prefill_role.prefill(host.service(body), body))

    async def decode(body: dict):
        svc = host.service(body)
        rid, q = await decode_role.decode(svc, body)
        return StreamingResponse(svc.relay(rid, q), media_type="application/x-ndjson")

    async def load_model(body: dict):
        code, out = await host.load(body.get("model"), body.get("weights"), body.get("keep", ()), body.get("wait_s"))
        return JSONResponse(out, status_code=code)

    async def unload_model(body: dict):
        return JSONResponse(await host.unload(body.get("model"), body.get("timeout_s", 30.0)))

    if role in ("both", "prefill", "decode"):
        app.post("/internal/generate")(guard(generate))  # any node can serve a whole request
    if role == "prefill":
        app.post("/internal/prefill")(guard(prefill))
    if role == "decode":
        app.post("/internal/decode")(guard(decode))
    app.post("/internal/models/load")(guard(load_model))
    app.post("/internal/models/unload")(guard(unload_model))

    @app.get("/internal/models")
    async def models():
        return host.models_view()

    @app.post("/internal/abort")
    async def abort(request: Request):
        body = await _json_object(request)
        if body is None:
            return JSONResponse({"detail": "body must be a JSON object"}, status_code=400)
        rid = str(body.get("request_id", ""))
        aborted = [svc.abort(rid) for svc in host.services()]  # on every model (the id is unique to one)
        return {"aborted": any(aborted)}

    @app.post("/internal/drain")
    async def drain(timeout_s: float = 60.0):
        return {"drained": await host.drain(timeout_s)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok = host.ready()
        return JSONResponse({"ready": ok, "state": host.state(), "draining": host.draining,
                             "progress": host.start_progress()}, status_code=200 if ok else 503)  # fmt: skip

    @app.get("/load")
    async def load():
        return host.view()

    held_gauges = host_registry(host.view)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest() + generate_latest(held_gauges), media_type=CONTENT_TYPE_LATEST)

    return app


async def _drive_senders(host: ModelHost) -> None:
    """Poll every model's held offers: drives NIXL notifications and hold deadlines (blocks come back on time)."""
    while True:
        await asyncio.sleep(0.005)
        for svc in host.services():
            sender = svc.sender
            if sender is None:
                continue
            for rid in list(svc.held):
                try:
                    sender.poll(rid)
                except KeyError:
                    svc.held.pop(rid, None)
                except Exception:  # one bad offer (or a model being unloaded) must not stop the loop
                    log.exception("polling KV offer %s", rid)
            try:
                sender.held()
            except Exception as e:  # noqa: BLE001 - closed by an unload meanwhile
                log.debug("KV sender of %s: %s", svc.config.model, e)
