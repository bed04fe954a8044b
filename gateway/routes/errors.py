"""Error replies of the gateway's HTTP API in OpenAI's shape (``{"error": {message, type, param, code}}``),
and the handlers that give FastAPI's own errors that shape: a validation error is a 400 naming its field
(no 422), an unknown field a 400 saying pdserve does not implement it, a 405 carries ``Allow``."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway.api.protocol import error_body
from gateway.service import REQUESTS

LEGACY_FIELDS = ("functions", "function_call")  # refused with their own message


class JSONReply(JSONResponse):
    """JSON whose strings may hold a lone surrogate (JSON lets a client send "\\ud800"; an admin body or a
    message may echo it): written as the escape it came in as, never a 500 from the UTF-8 encoder."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")  # only a surrogate cannot be encoded, and only inside a string: "\\udXXX"


def error_reply(status: int, message: str, type_: str = "invalid_request_error", param=None,
                headers=None) -> JSONResponse:  # fmt: skip
    """The error a route returns (counted by its status in ``pdserve_gateway_requests_total``)."""
    REQUESTS.labels(str(status)).inc()
    return JSONReply(error_body(message, type_, param, status), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # a validator's own message
        if first.get("type") == "json_invalid":
            msg, loc = "request body is not valid JSON", None
        elif first.get("type") == "extra_forbidden" and loc in LEGACY_FIELDS:
            return error_reply(400, f"{loc}: deprecated by OpenAI and not supported: use tools and tool_choice",
                               param=loc)  # fmt: skip
        elif first.get("type") == "extra_forbidden":
            return error_reply(400, f"unknown field {loc!r}: pdserve does not implement it (docs/api.md lists the "
                               "OpenAI fields it honours, refuses and ignores)", param=loc)  # fmt: skip
        return error_reply(400, f"{loc + ': ' if loc else ''}{msg}", param=loc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Allow: every method of every route on this path (RFC 9110)
            methods = {m for r in _leaves(app.router.routes) if r.matches(request.scope)[0] != Match.NONE
                       for m in getattr(r, "methods", None) or ()}  # fmt: skip
            headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))}
        return error_reply(exc.status_code, str(exc.detail),
                           "invalid_request_error" if exc.status_code < 500 else "server_error", headers=headers)


def _leaves(routes):
    """Every route, those of included routers too (FastAPI keeps an included APIRouter as one entry that
    holds it: ``original_router``; none of ours has a prefix, so their paths match as they are)."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        yield from _leaves(inner.routes) if inner is not None else (r,)
