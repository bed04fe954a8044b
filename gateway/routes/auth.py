"""Who may call which gateway route: the API keys for /v1/*, /tokenize and /detokenize, the admin key for
/admin/* (none set: closed, 401, unless the gateway runs with --open-admin), and requests signed with the
internal token for /internal/* (compute/node/auth.py, as requests to nodes are). Keys are compared in constant
time, every key every time. Without API keys the gateway answers only requests whose Host is a loopback name
(a page from another origin that rebinds its DNS name to 127.0.0.1 still sends its own name). Every check runs
before a byte of the body is read; then ``BodyLimit`` bounds
what is read (the declared Content-Length first, then the bytes as they come): 413 past ``max_body_bytes``.

Tenants (``cache_isolation = "per_key"``, the default when API keys are set): a /v1/* request's key names its
tenant, ``TENANT`` holds that tenant's cache salt for the request (an HMAC of the key under the internal
token: the same on every gateway of a deployment, and no key can be read back from it), and ``salted`` puts
it in front of the request's own ``cache_salt``, so one key's requests never share cached KV with another's
(a prefix cache shared across tenants is a timing side channel), whatever salt a client sends. Only then does
usage say ``cached_tokens`` (``report_cached_tokens = "isolated"``): with a shared cache (no keys, or
``cache_isolation = "shared"``) the count would tell one caller what another sent."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from compute.node.auth import BodyTooLarge, Identity, SignedOnly, answer_challenge, read_body, replaying
from gateway.admission.control import CALLER
from gateway.api.choices import SHOW_CACHED
from gateway.api.protocol import error_body

ADMIN_KEY_HINT = ".pdserve/keys/admin-PORT.key (read by `pdserve status`)"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")  # the Host a gateway without API keys answers (it binds loopback)
KEYED = ("/tokenize", "/detokenize")  # outside /v1/, under the API keys too
INTERNAL_MAX_BODY = 1 << 20  # the gateway's /internal/* take registrations and autoscaler reports: small JSON
TENANT: ContextVar[str | None] = ContextVar("pdserve_tenant", default=None)  # this request's tenant salt


def matching(request: Request, keys) -> str | None:
    """The key among `keys` the request's Bearer token is, or None."""
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    found = None
    for k in keys:  # constant time per key, and every key is compared
        if hmac.compare_digest(token.encode(), k.encode()):
            found = k
    return found


def authorized(request: Request, keys) -> bool:
    return matching(request, keys) is not None


def salted(cache_salt: str | None) -> str | None:
    """The request's ``cache_salt`` with this request's tenant salt before it (no tenant: as it is)."""
    tenant = TENANT.get()
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def install_auth(app: FastAPI, cfg, refuse: Callable) -> None:
    """The checks as middleware on `app` (GatewayConfig `cfg`); ``refuse(status, message, type)``: the error reply."""
    def internal_refusal(status: int, message: str) -> bytes:
        return json.dumps(error_body(message, "authentication_error", None, status)).encode()

    me = Identity(cfg.host, cfg.port)
    app.add_middleware(SignedOnly, token=cfg.internal_token or "", protected=lambda path: path.startswith("/internal/"),
                       identity=me, max_body=INTERNAL_MAX_BODY, refusal=internal_refusal)

    @app.post("/prove", include_in_schema=False)
    async def prove(request: Request):
        """The autoscaler's challenge before it believes this gateway's status (compute/node/auth.py ``Prover``):
        a pod that only carries the gateway's labels cannot answer it."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        status, reply = answer_challenge(cfg.internal_token or "", me, body, "gateway")
        return JSONResponse(reply, status_code=status)

    secret = (cfg.internal_token or secrets.token_hex(32)).encode()  # no token: one gateway, salts of its lifetime
    per_key = cfg.cache_isolation == "per_key"
    show_cached = cfg.report_cached_tokens == "always" or (
        cfg.report_cached_tokens == "isolated" and per_key and bool(cfg.api_keys))

    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, refusal=refuse)
    if not cfg.api_keys:  # open on loopback: a browser page on another origin (DNS rebinding) sends its own Host
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK_HOSTS))

    @app.middleware("http")
    async def keys(request: Request, call_next):  # (added last: it runs first)
        path = request.url.path
        SHOW_CACHED.set(show_cached)  # a shared cache's hit count would tell a caller what others sent
        if (path.startswith("/v1/") or path in KEYED) and cfg.api_keys:
            key = matching(request, cfg.api_keys)
            if key is None:
                return refuse(401, "missing or invalid API key", "authentication_error")
            caller = hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:32]
            CALLER.set(caller)  # admission takes turns between keys (gateway/admission/control.py)
            if per_key:
                TENANT.set(caller)
        if path.startswith("/admin/") and cfg.admin_closed:
            return refuse(401, "the admin API is closed: no admin key is set. `pdserve up` writes one to "
                          f"{ADMIN_KEY_HINT}; else set $PDSERVE_ADMIN_KEY (or start with --open-admin)",
                          "authentication_error")  # fmt: skip
        if path.startswith("/admin/") and cfg.admin_key and not authorized(request, [cfg.admin_key]):
            return refuse(401, "missing or invalid admin key", "authentication_error")
        return await call_next(request)


class BodyLimit:
    """ASGI middleware: a public request whose body is over ``limit`` bytes gets 413 (``refusal``'s reply) as soon
    as that is known: from its Content-Length before anything is read, else once the bytes read pass it (the body
    is read here, at most ``limit`` bytes, and handed on whole)."""

    def __init__(self, app, limit: int, refusal: Callable):
        self.app, self.limit, self.refusal = app, limit, refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/internal/") or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)  # (SignedOnly bounds /internal/*)
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), b"0")
        try:
            if not declared.isdigit() or int(declared) > self.limit:
                raise BodyTooLarge
            body = await read_body(receive, self.limit)
        except BodyTooLarge:
            reply = self.refusal(413, f"request body over {self.limit} bytes (max_body_bytes)", "invalid_request_error")
            return await reply(scope, receive, send)
        if body is not None:
            await self.app(scope, replaying(body, receive), send)
