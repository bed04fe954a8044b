"""Who may call which gateway route: the API keys for /v1/* (and /tokenize, /detokenize, checked in their
routes), the admin key for /admin/* (none set: closed, 401, unless the gateway runs with --open-admin), and
requests signed with the internal token for /internal/* (compute/node/auth.py, as requests to nodes are).
Keys are compared in constant time, every key every time."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from fastapi import FastAPI, Request

from compute.node.auth import SignedOnly

from gateway.api.protocol import error_body

ADMIN_KEY_HINT = ".pdserve/keys/admin-PORT.key (read by `pdserve status`)"


def authorized(request: Request, keys) -> bool:
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    ok = False
    for k in keys:  # constant time per key, and every key is compared
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return ok


def install_auth(app: FastAPI, cfg, refuse: Callable) -> None:
    """The checks as middleware on `app` (GatewayConfig `cfg`); ``refuse(status, message, type)``: the error reply."""
    app.add_middleware(SignedOnly, token=cfg.internal_token or "", protected=lambda path: path.startswith("/internal/"),
                       refusal=lambda status, message: json.dumps(error_body(message, "authentication_error", None,
                                                                             status)).encode())  # fmt: skip

    @app.middleware("http")
    async def keys(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/") and cfg.api_keys and not authorized(request, cfg.api_keys):
            return refuse(401, "missing or invalid API key", "authentication_error")
        if path.startswith("/admin/") and cfg.admin_closed:
            return refuse(401, "the admin API is closed: no admin key is set. `pdserve up` writes one to "
                          f"{ADMIN_KEY_HINT}; else set $PDSERVE_ADMIN_KEY (or start with --open-admin)",
                          "authentication_error")  # fmt: skip
        if path.startswith("/admin/") and cfg.admin_key and not authorized(request, [cfg.admin_key]):
            return refuse(401, "missing or invalid admin key", "authentication_error")
        return await call_next(request)
