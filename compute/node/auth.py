"""Who may call the node API, and how a node proves it is one: the internal token never crosses the wire.

The deployment shares one secret, the internal token (the gateway, the autoscaler, the nodes). It is
used as an HMAC-SHA256 key and never sent, so a process that receives a request learns nothing it
can replay or use elsewhere.

1. Every request to a node (and to the gateway's /internal/*) is signed (``SignedAuth``, an httpx.Auth
   that every client uses; ``signed_headers`` for a caller without httpx):
       X-Pdserve-Time: unix seconds          X-Pdserve-Nonce: 128 random bits, hex
       X-Pdserve-To: the receiver's origin as the caller addressed it (http://host:port)
       X-Pdserve-Signature: hex HMAC(token, "pdserve-request-v2" LF METHOD LF PATH[?QUERY] LF sha256(body) LF time
                                     LF nonce LF to)
   The receiver (``SignedOnly``, an ASGI middleware) checks, in this order and before it reads a byte of
   the body: the headers are there, ``Content-Length`` (if sent) is within ``max_body``, the time is
   within +-window_s of its clock and not before this process started (a request captured before a
   restart is not taken by the restarted process, whose nonce memory is new), the ``to`` origin names
   this receiver (``Identity``; a request signed for another node is refused by this one: a captured
   drain or unload cannot be replayed across the fleet), and the nonce is new. Then it reads the body,
   bounded by ``max_body``, and checks the MAC; only then is the nonce remembered. Any failure: 401
   (413 for a body over the cap), never a read of what follows.
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

TIME, NONCE, SIGNATURE, TO = "x-pdserve-time", "x-pdserve-nonce", "x-pdserve-signature", "x-pdserve-to"
_REQUEST, _PROOF = b"pdserve-request-v2", b"pdserve-node-proof-v1"
WINDOW_S = 30.0  # a signed request is accepted this long either side of the receiver's clock
MAX_BODY = 16 << 20  # bytes a signed request may carry (a 128k-token prompt's ids are ~1 MB of JSON)
START_SLACK_S = 1.0  # a signature this much older than the verifier is still taken (clock rounding; a restart
#   takes longer than this from the old process's last request to the new one's verifier)
MAX_NONCES = 1 << 20  # accepted nonces remembered within the window; beyond: 503 until they expire
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()


def signature(token: str, method: str, target: str | bytes, body: bytes, at: str, nonce: str, to: str) -> str:
    """The request signature over method, target (path and query, as sent), body digest, time, nonce and the
    receiver's origin (``to``)."""
    target = target if isinstance(target, bytes) else target.encode()
    return _mac(token, _REQUEST, method.upper().encode(), target, hashlib.sha256(body).hexdigest().encode(),
                at.encode(), nonce.encode(), to.encode())  # fmt: skip


def origin(url: str) -> str:
    """``http://host:port`` of a URL (the port always written): what ``X-Pdserve-To`` carries."""
    u = httpx.URL(url)
    return f"{u.scheme}://{u.host if ':' not in u.host else f'[{u.host}]'}:{u.port or {'https': 443}.get(u.scheme, 80)}"


def signed_headers(token: str, method: str, url: str, body: bytes = b"", to: str | None = None) -> dict[str, str]:
    """The headers that sign one request to ``url`` (its origin is the receiver unless ``to`` names it; its path
    and query are the target), for a caller without httpx: a preStop hook, curl."""
    u = httpx.URL(url)
    at, nonce, to = f"{time.time():.3f}", secrets.token_hex(16), origin(to or url)
    return {TIME: at, NONCE: nonce, TO: to, SIGNATURE: signature(token, method, u.raw_path, body, at, nonce, to)}


class SignedAuth(httpx.Auth):
    """An httpx.Auth that signs every request with the internal token (sync and async clients alike), each for
    the origin it is sent to; ``to``: the receiver's own origin instead, where it is reached through a
    forwarded port (``kubectl port-forward``, a published container port)."""

    requires_request_body = True  # the body's digest is signed

    def __init__(self, token: str, to: str | None = None):
        if not token:
            raise ValueError("no internal token: set $PDSERVE_INTERNAL_TOKEN")
        self._token, self._to = token, to

    def auth_flow(self, request):
        request.headers.update(signed_headers(self._token, request.method, str(request.url), request.content,
                                              self._to))  # fmt: skip
        yield request


def prove(token: str, nonce: str, url: str) -> str:
    """The node's answer to a challenge: it holds `token` and is the node at `url`."""
    return _mac(token, _PROOF, nonce.encode(), url.encode())


def check_proof(token: str, nonce: str, url: str, proof) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), prove(token, nonce, url).encode())


def challenge() -> str:
    return secrets.token_hex(16)


def answer_challenge(token: str, me: Identity, body, what: str = "node") -> tuple[int, dict]:
    """A /prove route's reply to ``body`` (the parsed JSON) for the receiver ``me`` (a ``what``): (status, JSON
    object)."""
    nonce, url = (body.get("nonce"), body.get("url")) if isinstance(body, dict) else (None, None)
    if not (isinstance(nonce, str) and 16 <= len(nonce) <= 128 and isinstance(url, str) and len(url) <= 2048):
        return 400, {"detail": f"want {{\"nonce\": 16-128 characters, \"url\": this {what}'s URL}}"}
    if not token:
        return 503, {"detail": "no internal token set: nothing to prove"}
    if not me.names(url):
        return 403, {"detail": f"{url[:200]!r} does not name this {what}"}
    return 200, {"proof": prove(token, nonce, url)}


class Prover:
    """Which peers a synchronous caller (the autoscaler) has seen prove the token at their URL, before it sends
    them a signed request or believes what they say. ``proven(url)``: yes from memory for ``ttl_s`` after a
    proof, else a challenge now; ``forget(url)`` after any failure to reach it, so whatever answers on that
    address next (a restarted peer, or a squatter) is challenged before it is used again."""

    def __init__(self, token: str, ttl_s: float = 60.0, timeout_s: float = 2.0):
        self.token, self.ttl_s = token, ttl_s
        self._http = httpx.Client(timeout=timeout_s)  # unsigned: a challenge carries nothing to replay
        self._at: dict[str, float] = {}  # url -> when it last proved
        self._lock = threading.Lock()  # the pool proves from its unload threads too

    def proven(self, url: str) -> bool:
        url, now = url.rstrip("/"), time.monotonic()
        if now - self._at.get(url, -self.ttl_s) < self.ttl_s:
            return True
        nonce, proof = challenge(), None
        try:
            r = self._http.post(url + "/prove", json={"nonce": nonce, "url": url})
            proof = r.json().get("proof") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        ok = check_proof(self.token, nonce, url, proof)
        with self._lock:
            self._at = {u: t for u, t in self._at.items() if now - t < self.ttl_s}  # bounded by a ttl's peers
            if ok:
                self._at[url] = now
            else:
                self._at.pop(url, None)
        return ok

    def forget(self, url: str) -> None:
        with self._lock:
            self._at.pop(url.rstrip("/"), None)

    def close(self) -> None:
        self._http.close()


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
    """Checks a signed request (the module doc's order): ``precheck`` on the headers alone, ``check`` with the
    body; a nonce is remembered only once the whole request passed."""

    def __init__(self, token: str, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time,
                 names: Callable[[str, bool], bool] = lambda to, local: True):  # fmt: skip
        """``names(origin, local)``: whether a request signed for that origin is for this receiver (``local``: the
        caller is on this host's loopback)."""
        if not token:
            raise ValueError("no internal token: every signed route would refuse every request")
        self.token, self.window_s, self.clock, self.names = token, window_s, clock, names
        self.started = clock()  # a signature made before this is not for this process
        self._seen: dict[str, float] = {}  # nonce -> when it expires (insertion order is time order)

    def precheck(self, headers: dict[str, str], local: bool = False) -> tuple[int, str] | None:
        """Before the body is read: None if the headers may belong to a fresh request for this receiver."""
        at, nonce, sig, to = headers.get(TIME), headers.get(NONCE), headers.get(SIGNATURE), headers.get(TO)
        if not (at and nonce and sig and to):
            return 401, "unsigned request: the internal API takes requests signed with the internal token"
        try:
            t = float(at)
        except ValueError:
            return 401, "bad X-Pdserve-Time"
        now = self.clock()
        if not abs(now - t) <= self.window_s:
            return 401, f"expired signature: signed {now - t:+.0f} s from now, outside the {self.window_s:g} s window"
        if t < self.started - START_SLACK_S:
            return 401, "signed before this process started: a request for an earlier run of this receiver"
        if not self.names(to, local):
            return 401, f"signed for another receiver ({to[:200]}): a request is taken only by the one it names"
        self._expire(now)
        if nonce in self._seen:
            return 401, "replayed request: this signature was already used"
        if len(self._seen) >= MAX_NONCES:
            return 503, "too many signed requests in the window: retry shortly"
        return None

    def check(self, method: str, target: bytes, body: bytes, headers: dict[str, str],
              local: bool = False) -> tuple[int, str] | None:  # fmt: skip
        """None if the request is signed, fresh, for this receiver and new (its nonce is then remembered)."""
        why = self.precheck(headers, local)
        if why is not None:
            return why
        at, nonce, sig, to = headers[TIME], headers[NONCE], headers[SIGNATURE], headers[TO]
        if not hmac.compare_digest(sig.encode(), signature(self.token, method, target, body, at, nonce, to).encode()):
            return 401, "invalid signature: not signed with this deployment's internal token"
        if nonce in self._seen:  # (another request with it passed while this body was read)
            return 401, "replayed request: this signature was already used"
        self._seen[nonce] = float(at) + self.window_s
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
    """ASGI middleware: requests to a path `protected(path)` must pass the ``Verifier`` (headers first, then the
    body read up to ``max_body`` and checked) and are handed on with the body unchanged. Others pass through
    untouched (streams too). ``identity``: which origins name this receiver (a loopback caller may also name
    it as ``127.0.0.1:PORT``: a preStop hook inside its pod)."""

    def __init__(self, app, token: str, protected: Callable[[str], bool], identity: Identity | None = None,
                 refusal: Callable[[int, str], bytes] = _json_refusal, window_s: float = WINDOW_S,
                 max_body: int = MAX_BODY):  # fmt: skip
        self.app, self.protected, self.refusal, self.max_body = app, protected, refusal, max_body
        self.identity = identity
        self.verifier = Verifier(token, window_s, names=self._names) if token else None

    def _names(self, to: str, local: bool) -> bool:
        if self.identity is None or self.identity.names(to):
            return True
        got = _host_port(to)  # the loopback name of this port, from a caller on this host
        return local and got is not None and got[0] in LOOPBACK and got[1] == self.identity.port

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.protected(scope["path"]):
            return await self.app(scope, receive, send)
        if self.verifier is None:
            return await self._refuse(send, 401, "no internal token configured: every internal route is refused")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        local = bool(scope.get("client")) and scope["client"][0] in LOOPBACK
        why = self.verifier.precheck(headers, local)
        if why is None and _length(headers) > self.max_body:
            why = 413, f"request body over {self.max_body} bytes"
        if why is not None:
            return await self._refuse(send, *why)
        try:
            body = await read_body(receive, self.max_body)
        except BodyTooLarge:
            return await self._refuse(send, 413, f"request body over {self.max_body} bytes")
        if body is None:
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        why = self.verifier.check(scope["method"], target, body, headers, local)
        if why is not None:
            return await self._refuse(send, *why)
        await self.app(scope, replaying(body, receive), send)

    async def _refuse(self, send, status: int, message: str) -> None:
        payload = self.refusal(status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _length(headers: dict[str, str]) -> int:
    """The declared Content-Length (0 when none: a chunked body is counted as it is read)."""
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 1 << 62  # unparseable: over any cap


class BodyTooLarge(Exception):
    """A request body read past its limit (``read_body``)."""


async def read_body(receive, limit: int) -> bytes | None:
    """An ASGI request's whole body, read up to ``limit`` bytes (BodyTooLarge past it); None: the client left."""
    body, more = bytearray(), True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
        if len(body) > limit:
            raise BodyTooLarge
    return bytes(body)


def replaying(body: bytes, receive):
    """An ASGI receive that gives ``body`` whole, then what ``receive`` gives (a disconnect, when it comes)."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
