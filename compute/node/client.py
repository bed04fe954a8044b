"""The one client of the node API (compute/node/protocol.py): routes, signing, timeouts and error mapping.

Two faces over the same routes: ``AsyncNodeClient`` (the gateway: requests, streams, the registry's
health poll; the benchmarks' load generator) and ``SyncNodeClient`` (the pool, the local actuator, the
launcher, the benchmarks: /load, /ready, drain, model load/unload, and one request at a time). Every
request is signed with the internal token (``auth.SignedAuth``) but the registry's challenge (``prove``),
which carries nothing but a nonce.

Errors say what the caller should do, from the refusal's ``kind`` (never its wording):
``RequestRejected`` (bad_request, or a 4xx without a kind): the request itself is wrong, retrying
elsewhere will not help; ``NodeFailed`` (overloaded, model_not_loaded, transfer_failed, internal, a 5xx,
a transport error, a stream cut short): try another node.

Partitions: an unreachable node refuses nothing (no RST): a connect hangs until its 2 s timeout, and an open stream
would sit silent until the read timeout (the gateway's ``node_timeout_s``, 60 s: a long prefill may be silent that
long). Every connection to a node therefore runs TCP keepalive (``PARTITION_OPTIONS``): probes after 1 s of
silence, every 1 s, and the connection fails once the peer's kernel has acknowledged nothing for 4 s (probes or
data: ``TCP_USER_TIMEOUT``). A busy node's kernel answers probes whatever its process does: only a host or link
that is gone trips them. Detected in ~5 s; the drill's streams finished on another node 7-9 s after the partition
(tests/net/test_partitions.py).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec

from compute.node import protocol as P
from compute.node.auth import SignedAuth

JSON = {"content-type": "application/json"}
PARTITION_OPTIONS = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
    (socket.IPPROTO_TCP, getattr(socket, name), value)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 4000))
    if hasattr(socket, name)]  # fmt: skip  (Linux has them all; elsewhere what the platform offers)


class NodeFailed(Exception):
    """The node (or the link to it) failed this request; retry it on another node."""

    def __init__(self, url: str, message: str, kind: str = "internal"):
        super().__init__(f"{url}: {message}")
        self.url, self.kind = url, kind


class RequestRejected(Exception):
    """The node refused the request itself (4xx): retrying elsewhere will not help."""

    def __init__(self, status: int, message: str, kind: str = "bad_request"):
        super().__init__(message)
        self.status, self.kind = status, kind


def check(url: str, r: httpx.Response) -> httpx.Response:
    """``r`` if it succeeded; else the error its kind (or, from a non-node answer, its status) calls for."""
    if r.status_code < 400:
        return r
    try:
        err = P.decode(r.content, P.NodeError)
        msg, kind = err.detail, err.kind
    except (msgspec.DecodeError, msgspec.ValidationError):
        msg, kind = r.text, None
    if kind == "bad_request" or (kind is None and r.status_code in (400, 401, 403, 404, 413, 422)):
        raise RequestRejected(r.status_code, str(msg), kind or "bad_request")
    raise NodeFailed(url, f"HTTP {r.status_code}: {msg}", kind or "internal")


def _reply(url: str, r: httpx.Response, type_):
    check(url, r)
    try:
        return P.decode(r.content, type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise NodeFailed(url, f"bad answer: {e}") from None


class AsyncNodeClient:
    """The gateway's face: one pooled connection set for every node."""

    def __init__(self, token: str | None, timeout_s: float, max_connections: int = 512):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(
            auth=SignedAuth(token) if token else None, timeout=httpx.Timeout(timeout_s, connect=2.0),
            transport=httpx.AsyncHTTPTransport(limits=limits, socket_options=PARTITION_OPTIONS),
        )  # fmt: skip

    async def close(self) -> None:
        await self.client.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def prefill(self, url: str, msg: P.GenerateRequest) -> P.PrefillReply:
        try:
            r = await self.client.post(url + "/internal/prefill", content=P.encode(msg), headers=JSON)
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"prefill: {type(e).__name__}: {e}") from None
        return _reply(url, r, P.PrefillReply)

    def generate(self, url: str, msg: P.GenerateRequest) -> AsyncIterator[P.StreamLine]:
        return self._stream(url, "generate", msg)

    def decode(self, url: str, msg: P.DecodeRequest) -> AsyncIterator[P.StreamLine]:
        return self._stream(url, "decode", msg)

    async def _stream(self, url: str, route: str, msg) -> AsyncIterator[P.StreamLine]:
        """Lines of a generate/decode stream; NodeFailed if it breaks before a finish_reason."""
        try:
            async with self.client.stream("POST", f"{url}/internal/{route}", content=P.encode(msg),
                                          headers=JSON) as r:  # fmt: skip
                if r.status_code >= 400:
                    await r.aread()
                    check(url, r)
                async for line in r.aiter_lines():
                    if line:
                        out = _line(url, route, line)
                        yield out
                        if out.finish_reason:
                            return
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"{route}: {type(e).__name__}: {e}") from None
        raise NodeFailed(url, f"{route}: stream ended without a finish reason")

    async def export(self, url: str, msg: P.ExportRequest, timeout_s: float = 2.0) -> P.ExportReply:
        """POST /internal/kv/export: the node's cached prefix of a prompt, held for a peer to pull (its handle);
        NodeFailed / RequestRejected if it cannot (nothing cached, draining, gone)."""
        return await self._peer_kv(url, "export", msg, P.ExportReply, timeout_s)

    async def import_kv(self, url: str, msg: P.ImportRequest, timeout_s: float = 15.0) -> P.ImportReply:
        """POST /internal/kv/import: the node pulls a peer's export into its prefix cache (a pre-pull)."""
        return await self._peer_kv(url, "import", msg, P.ImportReply, timeout_s)

    async def _peer_kv(self, url: str, verb: str, msg, reply: type, timeout_s: float):
        try:
            r = await self.client.post(f"{url}/internal/kv/{verb}", content=P.encode(msg), headers=JSON,
                                       timeout=timeout_s)  # fmt: skip
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"{verb}: {type(e).__name__}: {e}") from None
        return _reply(url, r, reply)

    async def abort(self, url: str, request_id: str) -> None:
        try:
            await self.client.post(url + "/internal/abort", content=P.encode(P.AbortRequest(request_id)),
                                   headers=JSON, timeout=2.0)  # fmt: skip
        except httpx.HTTPError:
            pass  # the node is gone or will time the request out itself

    async def load(self, url: str, timeout_s: float = 2.0) -> P.LoadReport:
        """GET /load; httpx.HTTPError (transport, 5xx) or ValueError (not a load report) if it fails."""
        r = await self.client.get(url + "/load", timeout=timeout_s)
        r.raise_for_status()
        return P.decode(r.content, P.LoadReport)

    async def cache(self, url: str, since: dict[str, P.CacheCursor], timeout_s: float = 5.0) -> P.CacheReport:
        """POST /internal/cache: per ready model, its prefix cache's change since ``since[model]`` (a model
        not in it: a snapshot); httpx.HTTPError or ValueError if it fails."""
        r = await self.client.post(url + "/internal/cache", content=P.encode(P.CacheQuery(since)), headers=JSON,
                                   timeout=timeout_s)  # fmt: skip
        r.raise_for_status()
        return P.decode(r.content, P.CacheReport)

    async def prove(self, url: str, nonce: str, timeout_s: float = 2.0) -> tuple[int, str | None, str]:
        """The challenge, unsigned -> (status, proof or None, body text); raises on transport errors and 5xx."""
        r = await self.client.post(url + "/prove", json={"nonce": nonce, "url": url}, auth=None, timeout=timeout_s)
        if r.status_code >= 500:
            r.raise_for_status()
        try:
            proof = r.json().get("proof") if r.status_code == 200 else None
        except (ValueError, AttributeError):
            proof = None
        return r.status_code, proof if isinstance(proof, str) or proof is None else None, r.text


class SyncNodeClient:
    """The control plane's face (threads): /ready, /load, drain, model load and unload; and requests one at
    a time, as a benchmark times them (``prefill``, ``generate``, ``decode``)."""

    def __init__(self, token: str | None, timeout_s: float = 5.0, auth: httpx.Auth | None = None):
        """``auth``: a ``SignedAuth`` already made (instead of ``token``)."""
        self.client = httpx.Client(auth=auth or (SignedAuth(token) if token else None), timeout=timeout_s,
                                   transport=httpx.HTTPTransport(socket_options=PARTITION_OPTIONS))  # fmt: skip

    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ready(self, url: str, timeout_s: float = 2.0) -> bool:
        """/ready answers 200 (False on any transport error)."""
        try:
            return self.client.get(url + "/ready", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def load(self, url: str, timeout_s: float | None = None) -> P.LoadReport:
        """GET /load; httpx.HTTPError or ValueError (msgspec's) if it fails."""
        r = self.client.get(url + "/load", **({} if timeout_s is None else {"timeout": timeout_s}))
        r.raise_for_status()
        return P.decode(r.content, P.LoadReport)

    def drain(self, url: str, timeout_s: float) -> P.DrainReply:
        r = self.client.post(url + "/internal/drain", params={"timeout_s": timeout_s}, timeout=timeout_s + 5)
        return _reply(url, r, P.DrainReply)

    def load_model(self, url: str, msg: P.ModelLoadRequest) -> P.ModelLoadReply:
        """-> the reply (loading or already held); RequestRejected (404: not in the store), NodeFailed."""
        try:
            r = self.client.post(url + "/internal/models/load", content=P.encode(msg), headers=JSON)
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"load {msg.model}: {type(e).__name__}: {e}") from None
        return _reply(url, r, P.ModelLoadReply)

    def unload_model(self, url: str, msg: P.ModelUnloadRequest) -> P.ModelUnloadReply:
        try:
            r = self.client.post(url + "/internal/models/unload", content=P.encode(msg), headers=JSON,
                                 timeout=msg.timeout_s + 10)  # fmt: skip
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"unload {msg.model}: {type(e).__name__}: {e}") from None
        return _reply(url, r, P.ModelUnloadReply)

    def prefill(self, url: str, msg: P.GenerateRequest) -> P.PrefillReply:
        try:
            r = self.client.post(url + "/internal/prefill", content=P.encode(msg), headers=JSON)
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"prefill: {type(e).__name__}: {e}") from None
        return _reply(url, r, P.PrefillReply)

    def generate(self, url: str, msg: P.GenerateRequest) -> Iterator[P.StreamLine]:
        return self._stream(url, "generate", msg)

    def decode(self, url: str, msg: P.DecodeRequest) -> Iterator[P.StreamLine]:
        return self._stream(url, "decode", msg)

    def _stream(self, url: str, route: str, msg) -> Iterator[P.StreamLine]:
        """As ``AsyncNodeClient._stream``: each line as it arrives, to the one with a finish_reason."""
        try:
            with self.client.stream("POST", f"{url}/internal/{route}", content=P.encode(msg), headers=JSON) as r:
                if r.status_code >= 400:
                    r.read()
                    check(url, r)
                for line in r.iter_lines():
                    if line:
                        out = _line(url, route, line)
                        yield out
                        if out.finish_reason:
                            return
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"{route}: {type(e).__name__}: {e}") from None
        raise NodeFailed(url, f"{route}: stream ended without a finish reason")


def _line(url: str, route: str, line: str) -> P.StreamLine:
    try:
        return P.decode(line, P.StreamLine)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise NodeFailed(url, f"{route}: bad stream line: {e}") from None
