"""The gateway's FastAPI app: its lifespan (``Gateway.start`` / ``stop``), its OpenAPI document, and its
route groups, one APIRouter per surface (gateway/routes/):

  openai    /v1/* (chat, completions, responses, models), /tokenize, /detokenize   API keys, if set
  health    /health, /ready, /metrics, /load                                         open
  admin     /admin/* (nodes, status, the autoscaler's report)                       the admin key
  internal  /internal/* (the autoscaler's view and reports, node registration)      signed with the internal token

Auth is middleware in front of them all (``routes.auth``); errors have OpenAI's shape (``routes.errors``)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.api.openapi import describe
from gateway.routes.admin import admin_router
from gateway.routes.auth import install_auth
from gateway.routes.errors import JSONReply, error_reply, install_error_handlers
from gateway.routes.health import health_router
from gateway.routes.internal import internal_router
from gateway.routes.openai import openai_router
from gateway.service import Gateway


def create_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="pdserve gateway", lifespan=lifespan, default_response_class=JSONReply)
    cfg = gw.config

    def openapi() -> dict:
        """FastAPI's document, completed by ``openapi.describe`` with what this gateway serves."""
        if app.openapi_schema is None:
            bearer = {"api_key": ["/v1/", "/tokenize", "/detokenize"]} if cfg.api_keys else {}
            if not cfg.admin_open or cfg.admin_key:
                bearer["admin_key"] = ["/admin/"]
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            max_tokens, vocab, takes_tools = gw.document_limits()
            app.openapi_schema = describe(doc, gw.models.names, max_tokens, vocab, bearer, takes_tools)
        return app.openapi_schema

    app.openapi = openapi
    install_auth(app, cfg, error_reply)
    install_error_handlers(app)
    app.include_router(health_router(gw))
    app.include_router(openai_router(gw))
    app.include_router(admin_router(gw))
    app.include_router(internal_router(gw))
    return app
