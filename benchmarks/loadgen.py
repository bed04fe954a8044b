"""Client-side load generation for the benchmarks: one request as the client saw it, and closed loops.

``chat_stream`` sends a streaming chat completion through the gateway (SSE); ``node_stream``
sends the same token ids straight to a node's ``/internal/generate`` (NDJSON); ``closed_loop``
shares a bounded number of requests among N clients; ``summarize`` turns samples into the
table row every benchmark prints. Used by `pdserve bench gateway` and `pdserve bench burst`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from compute.engine.sampling import SamplingParams
from compute.node import protocol as P


@dataclass(slots=True)
class Sample:
    """One request as the client saw it (times in seconds; start on the client's monotonic clock)."""

    start: float
    ok: bool = False
    ttft: float | None = None
    tpot: float | None = None  # (last token - first token) / (tokens - 1)
    tokens: int = 0
    end: float = 0.0
    error: str = ""


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _finish(s: Sample, first: float | None, last: float | None, tokens: int) -> Sample:
    s.end = time.monotonic()
    s.tokens = tokens
    if first is not None:
        s.ttft = first - s.start
        if tokens > 1 and last is not None:
            s.tpot = (last - first) / (tokens - 1)
    return s


async def chat_stream(client, url: str, model: str, prompt: str, max_tokens: int, api_key: str | None = None,
                      extra: dict | None = None) -> Sample:  # fmt: skip
    """One streaming chat completion through the gateway (SSE, usage included)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    s = Sample(start=time.monotonic())
    first = last = None
    tokens = chunks = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return _finish(s, None, None, 0)
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    s.error = str(msg["error"].get("message", msg["error"]))[:200]
                    break
                if msg.get("usage"):
                    tokens = int(msg["usage"]["completion_tokens"])
                for ch in msg.get("choices") or []:
                    if ch.get("delta", {}).get("content"):
                        now = time.monotonic()
                        first = first if first is not None else now
                        last, chunks = now, chunks + 1
            s.ok = done and not s.error and tokens > 0
            if done and not tokens and not s.error:
                s.error = "stream ended without usage"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        s.error = f"{type(e).__name__}: {e}"[:200]
    return _finish(s, first, last, tokens or chunks)


async def node_stream(nodes, url: str, prompt_ids: list[int], max_tokens: int) -> Sample:
    """The same request straight to a node's /internal/generate (NDJSON), through ``nodes``, an
    ``AsyncNodeClient`` (compute/node/client.py: the one node client; it yields each line as it arrives)."""
    msg = P.GenerateRequest(uuid.uuid4().hex, prompt_ids,
                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))  # fmt: skip
    s = Sample(start=time.monotonic())
    first = last = None
    tokens = 0
    try:
        async for line in nodes.generate(url, msg):
            if line.token_ids:
                now = time.monotonic()
                first = first if first is not None else now
                last = now
                tokens += len(line.token_ids)
            if line.finish_reason:
                s.ok = line.finish_reason in ("stop", "length", "eos")
                if not s.ok:
                    s.error = line.error or line.finish_reason
    except Exception as e:  # noqa: BLE001
        s.error = f"{type(e).__name__}: {e}"[:200]
    return _finish(s, first, last, tokens)


async def closed_loop(make, concurrency: int, requests: int, until: float | None = None) -> tuple[list[Sample], float]:
    """`concurrency` clients share `requests` requests (none started after `until`, monotonic time, when given);
    -> (samples, wall seconds)."""
    left = [requests]
    out: list[Sample] = []

    async def client():
        while left[0] > 0 and (until is None or time.monotonic() < until):
            left[0] -= 1
            out.append(await make())

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, time.monotonic() - t0


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    ms = lambda x: None if x is None else round(x * 1000, 2)
    return {"requests": len(samples), "failed": len(samples) - len(ok), "wall_s": round(wall, 3),
            "req_per_s": round(len(ok) / wall, 3) if wall else None,
            "tok_per_s": round(sum(s.tokens for s in ok) / wall, 2) if wall else None,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
            "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p99_ms": ms(pct(tpot, 99)),
            "errors": sorted({s.error for s in samples if s.error})[:5]}  # fmt: skip


# --- the benchmark ----------------------------------------------------------------------------------------
