"""The node's internal HTTP API (FastAPI): what the gateway and the autoscaler call.

Requests (``/internal/generate|prefill|decode``) carry ``"model"`` (absent: the node's only model)
and go to that model's ``NodeService``; a model not held or not ready here -> 503 (the gateway tries
elsewhere). Models are loaded and unloaded with ``/internal/models/load|unload`` (``models.ModelHost``).
Every body is decoded as its message type (compute/node/protocol.py; a field not in it is refused, 400);
every refusal is a ``NodeError`` whose kind says what the caller should do.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from compute.node import auth, peer
from compute.node import decode as decode_role
from compute.node import prefill as prefill_role
from compute.node import protocol as P
from compute.node.errors import BadNodeRequest, NodeBusy
from compute.node.metrics import host_registry
from compute.node.models import ModelHost, ModelNotHeld, ModelUnknown
from compute.node.service import check_request, new_sequence, sampling_params
from compute.node.streaming import ClosingStreamingResponse

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


def raw(msg, status: int = 200) -> Response:
    """A message (a protocol Struct or plain data) as a JSON response, encoded by msgspec."""
    return Response(P.encode(msg), status_code=status, media_type="application/json")


def refuse(detail: str, kind: str, status: int | None = None) -> Response:
    return raw(P.NodeError(detail, kind), status or P.STATUS[kind])


def create_app(host: ModelHost) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_drive_senders(host)) if host.cfg.role == "prefill" or host.cfg.peer_kv else None
        yield
        if task:
            task.cancel()

    app = FastAPI(title="pdserve node", lifespan=lifespan)
    role = host.cfg.role
    cfg = host.cfg
    me = auth.Identity(cfg.host, cfg.port, cfg.advertise_url)
    app.add_middleware(auth.SignedOnly, token=cfg.internal_token, protected=lambda path: path not in OPEN_PATHS,
                       identity=me)  # a request signed for another node is refused here

    @app.post("/prove")
    async def prove(request: Request):
        """The challenge the gateway sends before it registers this node (compute/node/auth.py)."""
        status, reply = auth.answer_challenge(cfg.internal_token, me, await _json_object(request))
        return JSONResponse(reply, status_code=status)

    def guard(fn, type_):
        """A route taking a ``type_`` message; every refusal a NodeError whose kind says what to do."""

        async def run(request: Request):
            try:
                msg = P.decode(await request.body(), type_)
            except msgspec.DecodeError as e:
                return refuse(f"body is not valid JSON: {e}", "bad_request")
            except msgspec.ValidationError as e:
                return refuse(f"invalid {type_.__name__}: {e}", "bad_request")
            try:
                return await fn(msg)
            except (BadNodeRequest, NodeBusy) as e:
                return refuse(str(e), e.kind)
            except ModelUnknown as e:
                return refuse(str(e), "bad_request", 404)
            except ModelNotHeld as e:
                return refuse(str(e), "model_not_loaded", 404)

        return run

    async def generate(msg: P.GenerateRequest):
        svc = host.service(msg.model)
        svc.check_accepting()
        check_request(msg)
        svc.check_tokens(msg.prompt_token_ids)
        seq = new_sequence(msg, sampling_params(msg))
        await svc.prepare(seq)
        q = await svc.add(msg.request_id, seq, "generate", peer.puller(msg.pull))
        return ClosingStreamingResponse(svc.relay(msg.request_id, q), media_type="application/x-ndjson")

    async def prefill(msg: P.GenerateRequest):
        return raw(await prefill_role.prefill(host.service(msg.model), msg))

    async def decode(msg: P.DecodeRequest):
        svc = host.service(msg.model)
        rid, q = await decode_role.decode(svc, msg)
        return ClosingStreamingResponse(svc.relay(rid, q), media_type="application/x-ndjson")

    async def export(msg: P.ExportRequest):
        return raw(await peer.export(host.service(msg.model), msg))

    async def import_kv(msg: P.ImportRequest):
        return raw(P.ImportReply(await peer.import_chain(host.service(msg.model), msg.kv)))

    async def load_model(msg: P.ModelLoadRequest):
        code, out = await host.load(msg.model, msg.weights, msg.keep, msg.wait_s)
        return raw(out, code)

    async def unload_model(msg: P.ModelUnloadRequest):
        return raw(await host.unload(msg.model, msg.timeout_s))

    if role in ("both", "prefill", "decode"):
        app.post("/internal/generate")(guard(generate, P.GenerateRequest))  # any node can serve a whole request
    if role == "prefill":
        app.post("/internal/prefill")(guard(prefill, P.GenerateRequest))
    if role == "decode":
        app.post("/internal/decode")(guard(decode, P.DecodeRequest))
    if cfg.peer_kv:
        app.post("/internal/kv/export")(guard(export, P.ExportRequest))  # a cached prefix, for a peer to pull
        app.post("/internal/kv/import")(guard(import_kv, P.ImportRequest))  # a peer's, into this cache (pre-pull)
    app.post("/internal/models/load")(guard(load_model, P.ModelLoadRequest))
    app.post("/internal/models/unload")(guard(unload_model, P.ModelUnloadRequest))

    @app.get("/internal/models")
    async def models():
        return raw(host.models_view())

    async def abort(msg: P.AbortRequest):
        aborted = [svc.abort(msg.request_id) for svc in host.services()]  # on every model (the id is unique to one)
        return raw(P.AbortReply(any(aborted)))

    app.post("/internal/abort")(guard(abort, P.AbortRequest))

    async def cache(msg: P.CacheQuery):
        """Per ready model, its prefix cache since the consumer's cursor (compute/node/cache_feed.py)."""
        out = {}
        for name, h in list(host.models.items()):
            svc = h.svc
            if h.state != "ready" or svc is None:
                continue
            try:
                out[name] = await svc.cache_feed.report(msg.since.get(name))
            except (asyncio.TimeoutError, AttributeError):  # unloaded meanwhile: its engine thread is gone
                continue
        return raw(P.CacheReport(out))

    app.post("/internal/cache")(guard(cache, P.CacheQuery))

    @app.post("/internal/drain")
    async def drain(timeout_s: float = 60.0):
        return raw(P.DrainReply(await host.drain(timeout_s)))

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
        return raw(host.view())

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
