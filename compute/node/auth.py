"""Who may call the node API, and how a node proves it is one: the internal token never crosses the wire.

The deployment shares one secret, the internal token (the gateway, the autoscaler, the nodes). It is
used as an HMAC-SHA256 key and never sent, so a process that receives a request learns nothing it
can replay or use elsewhere.

1. Every request to a node (and to the gateway's /internal/*) is signed (``SignedAuth``, an httpx.Auth
   that every client uses; ``signed_headers`` for a caller without httpx):
       X-Pdserve-Time: unix seconds          X-Pdserve-Nonce: 128 random bits, hex
       X-Pdserve-Signature: hex HMAC(token, "pdserve-request-v1" LF METHOD LF PATH[?QUERY] LF sha256(body) LF time LF nonce)
   The receiver (``SignedOnly``, an ASGI middleware) refuses with 401 a missing or wrong signature, a
   time outside +-window_s of its clock, and a nonce it has already accepted within the window (a
   captured request replayed).
2. A node proves it holds the token before anything is sent to it (``prove`` / ``check_proof``): the
   gateway POSTs /prove {"nonce", "url"} (unsigned, a fresh random nonce) and the node answers
   {"proof": hex HMAC(token, "pdserve-node-proof-v1" LF nonce LF url)} only for a URL that names it
   (``Identity``: its advertised URL, else its bind address and port), so a relay in front of a real
   node cannot pass the real node's proof off as its own. The gateway registers, polls and routes
   only to nodes that answered the proof.

Why HMAC from the standard library and not a signing library: both ends hold the same secret, so a
MAC is the primitive (a public-key signature such as Ed25519 buys nothing when every verifier also
holds what signs); `hmac` is the stdlib's, keyed SHA-256 (RFC 2104), with `compare_digest` for
constant-time checks. The two messages carry different domain prefixes, so a proof is never a
valid request signature and the reverse. What is signed follows AWS SigV4's canonical request
(method, path and query, a body digest, a timestamp), reduced to what the node API needs.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

TIME, NONCE, SIGNATURE = "x-pdserve-time", "x-pdserve-nonce", "x-pdserve-signature"
_REQUEST, _PROOF = b"pdserve-request-v1", b"pdserve-node-proof-v1"
WINDOW_S = 30.0  # a signed request is accepted this long either side of the receiver's clock
MAX_BODY = 64 << 20  # bytes a signed request may carry (a prompt of a long context is a few MB of JSON)
MAX_NONCES = 1 << 20  # accepted nonces remembered within the window; beyond: 503 until they expire
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()


def signature(token: str, method: str, target: str | bytes, body: bytes, at: str, nonce: str) -> str:
    """The request signature over method, target (path and query, as sent), body digest, time, nonce."""
    target = target if isinstance(target, bytes) else target.encode()
    return _mac(token, _REQUEST, method.upper().encode(), target, hashlib.sha256(body).hexdigest().encode(),
                at.encode(), nonce.encode())  # fmt: skip


def signed_headers(token: str, method: str, target: str | bytes, body: bytes = b"") -> dict[str, str]:
    """The three headers that sign one request (a caller without httpx: a preStop hook, curl)."""
    at, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    return {TIME: at, NONCE: nonce, SIGNATURE: signature(token, method, target, body, at, nonce)}


def _sign(token: str, request) -> None:
    request.headers.update(signed_headers(token, request.method, request.url.raw_path, request.content))


class SignedAuth(httpx.Auth):
    """An httpx.Auth that signs every request with the internal token (sync and async clients alike)."""

    requires_request_body = True  # the body's digest is signed

    def __init__(self, token: str):
        if not token:
            raise ValueError("no internal token: set $PDSERVE_INTERNAL_TOKEN")
        self._token = token

    def auth_flow(self, request):
        _sign(self._token, request)
        yield request


def prove(token: str, nonce: str, url: str) -> str:
    """The node's answer to a challenge: it holds `token` and is the node at `url`."""
    return _mac(token, _PROOF, nonce.encode(), url.encode())


def check_proof(token: str, nonce: str, url: str, proof) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), prove(token, nonce, url).encode())


def challenge() -> str:
    return secrets.token_hex(16)


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        u = urlsplit(url)
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or port is None:
        return None
    host = u.hostname.lower()
    try:
        host = str(ipaddress.ip_address(host))  # one spelling per address
    except ValueError:
        pass
    return host, port


@dataclass(slots=True, frozen=True)
class Identity:
    """Which URLs name this node: its advertised URL exactly; else its bind address and port (a loopback
    bind answers for every loopback name; a wildcard bind for any host on its port, which a relay on
    another host with the same port could pass: advertise the URL where that matters, as the pods do)."""

    host: str
    port: int
    advertise_url: str | None = None

    def names(self, url: str) -> bool:
        got = _host_port(url)
        if got is None:
            return False
        if self.advertise_url:
            return got == _host_port(self.advertise_url)
        host, port = got
        if port != self.port:
            return False
        if self.host in WILDCARD:
            return True
        mine = _host_port(f"http://{self.host if ':' not in self.host else f'[{self.host}]'}:{self.port}")
        if mine and mine[0] in LOOPBACK:
            return host in LOOPBACK
        return mine is not None and host == mine[0]


class Verifier:
    """Checks a signed request: the signature, the time window, the nonce seen once."""

    def __init__(self, token: str, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time):
        if not token:
            raise ValueError("no internal token: every signed route would refuse every request")
        self.token, self.window_s, self.clock = token, window_s, clock
        self._seen: dict[str, float] = {}  # nonce -> when it expires (insertion order is time order)

    def check(self, method: str, target: bytes, body: bytes, headers: dict[str, str]) -> tuple[int, str] | None:
        """None if the request is signed, fresh and new; else (status, why)."""
        at, nonce, sig = headers.get(TIME), headers.get(NONCE), headers.get(SIGNATURE)
        if not (at and nonce and sig):
            return 401, "unsigned request: the internal API takes requests signed with the internal token"
        try:
            t = float(at)
        except ValueError:
            return 401, "bad X-Pdserve-Time"
        if t != t or not hmac.compare_digest(sig.encode(), signature(self.token, method, target, body, at, nonce).encode()):
            return 401, "invalid signature: not signed with this deployment's internal token"
        now = self.clock()
        if abs(now - t) > self.window_s:
            return 401, f"expired signature: signed {now - t:+.0f} s from now, outside the {self.window_s:g} s window"
        self._expire(now)
        if nonce in self._seen:
            return 401, "replayed request: this signature was already used"
        if len(self._seen) >= MAX_NONCES:
            return 503, "too many signed requests in the window: retry shortly"
        self._seen[nonce] = t + self.window_s
        return None

    def _expire(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until >= now:
                return
            del self._seen[nonce]


def _json_refusal(status: int, message: str) -> bytes:
    return json.dumps({"detail": message}).encode()


class SignedOnly:
    """ASGI middleware: requests to a path `protected(path)` must pass ``Verifier.check``; the body is
    read (bounded), checked, and handed on unchanged. Others pass through untouched (streams too)."""

    def __init__(self, app, token: str, protected: Callable[[str], bool],
                 refusal: Callable[[int, str], bytes] = _json_refusal, window_s: float = WINDOW_S):
        self.app, self.protected, self.refusal = app, protected, refusal
        self.verifier = Verifier(token, window_s) if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.protected(scope["path"]):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > MAX_BODY:
                return await self._refuse(send, 413, f"request body over {MAX_BODY} bytes")
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        why = (401, "no internal token configured: every internal route is refused") if self.verifier is None else \
            self.verifier.check(scope["method"], target, bytes(body), headers)  # fmt: skip
        if why is not None:
            return await self._refuse(send, *why)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # after the body: a disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send, status: int, message: str) -> None:
        payload = self.refusal(status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
