"""HTTP client of the node API (the gateway's side of the internal protocol).

Node API (every route but /health, /ready, /metrics and /prove takes only requests signed with the
internal token: compute/node/auth.py; the registry sends requests only to nodes that proved they hold it):
  POST /internal/generate {model, request_id, prompt_token_ids, params}  -> NDJSON stream (role both)
  POST /internal/prefill  {model, request_id, prompt_token_ids, params}  -> {token_ids, finish_reason, kv}
  POST /internal/decode   {model, request_id, prompt_token_ids, first_token_id, params, kv} -> NDJSON stream
  POST /internal/abort    {request_id}
  GET  /load, /ready, /health, /metrics
``model`` names which of the node's models serves it (a model not held or not ready there: 503, the
gateway tries elsewhere). A stream line is ``{"token_ids": [...], "finish_reason": null | "stop" | "length" | "abort" | "error", "error"?}``.
``params.replay_tokens``: after a failover the prompt ends with tokens already streamed; the
node recomputes them one per step, as the lost decode did, so greedy output continues
bit-identically (prefill-sized matmuls take another kernel and can flip near-ties).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from compute.node.auth import SignedAuth


class NodeFailed(Exception):
    """The node (or the link to it) failed this request; retry it on another node."""

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url = url


class RequestRejected(Exception):
    """The node refused the request itself (4xx): retrying elsewhere will not help."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class NodeClient:
    def __init__(self, token: str | None, timeout_s: float):
        self.client = httpx.AsyncClient(
            auth=SignedAuth(token) if token else None, timeout=httpx.Timeout(timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )  # fmt: skip

    async def close(self) -> None:
        await self.client.aclose()

    async def prefill(self, url: str, body: dict) -> dict:
        try:
            r = await self.client.post(url + "/internal/prefill", json=body)
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"prefill: {type(e).__name__}: {e}") from None
        return _check(url, r).json()

    async def stream(self, url: str, route: str, body: dict) -> AsyncIterator[dict]:
        """Lines of a generate/decode stream; NodeFailed if it breaks before a finish_reason."""
        try:
            async with self.client.stream("POST", f"{url}/internal/{route}", json=body) as r:
                if r.status_code >= 400:
                    await r.aread()
                    _check(url, r)
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    msg = json.loads(line)
                    yield msg
                    if msg.get("finish_reason"):
                        return
        except httpx.HTTPError as e:
            raise NodeFailed(url, f"{route}: {type(e).__name__}: {e}") from None
        raise NodeFailed(url, f"{route}: stream ended without a finish reason")

    async def abort(self, url: str, request_id: str) -> None:
        try:
            await self.client.post(url + "/internal/abort", json={"request_id": request_id}, timeout=2.0)
        except httpx.HTTPError:
            pass  # the node is gone or will time the request out itself


def _check(url: str, r: httpx.Response) -> httpx.Response:
    if r.status_code < 400:
        return r
    try:
        msg = r.json().get("detail") or r.text
    except ValueError:
        msg = r.text
    if r.status_code in (400, 404, 413, 422):
        raise RequestRejected(r.status_code, str(msg))
    raise NodeFailed(url, f"HTTP {r.status_code}: {msg}")
