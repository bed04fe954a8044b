"""Several choices in one response: a list of prompts (completions), ``n`` per prompt, ``best_of``.

Choice ``i * n + k`` is prompt ``i``'s ``k``-th (OpenAI's order). Each choice runs as a request of
its own through admission, routing and failover (``Gateway.generate``), and:

- seeds: choice ``k`` of a seeded request draws with ``seed + k`` (vLLM's rule): each choice is
  reproducible, and the choices differ;
- one prompt's choices carry one ``fork_group`` and share an ``Affinity``: routed together, the
  node computes their prompt once and forks them (compute/engine/scheduler.py: shared KV blocks,
  copy-on-write), instead of ``n`` prefills;
- ``best_of`` (completions, not streamed): ``best_of`` choices per prompt are generated and the
  ``n`` with the highest mean token logprob are returned (OpenAI's "highest log probability per
  token"); usage counts every token generated.

Streamed, the choices' SSE events interleave as they come (each carries its index), then one usage
chunk (if asked) and ``[DONE]``; the prompt is counted once per prompt in the usage, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from dataclasses import dataclass, field

from gateway.routing.relay import Affinity

# whether this request's usage may say its cached_tokens (set per request by gateway/routes/auth.py: only where
# the cache is the caller's own, unless report_cached_tokens says otherwise)
SHOW_CACHED: ContextVar[bool] = ContextVar("pdserve_show_cached", default=False)


@dataclass(slots=True)
class Job:
    """One choice to generate: its prompt, token limit, index and what its node request adds."""

    prompt: list[int]
    limit: int
    index: int
    params: dict = field(default_factory=dict)  # merged into the node params: seed, fork_group
    affinity: Affinity | None = None


def jobs(prompts: list[list[int]], limits: list[int], n: int, seed: int | None, rid: str) -> list[Job]:
    """``n`` jobs per prompt in OpenAI's order; a prompt's jobs share a fork group and a route."""
    out = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        affinity = Affinity() if n > 1 else None
        for k in range(n):
            extra = {"fork_group": f"{rid}.{i}"} if n > 1 else {}
            if seed is not None and k:
                extra["seed"] = (seed + k) % 2**63
            out.append(Job(prompt, limit, i * n + k, extra, affinity))
    return out


def mean_logprob(choice: dict, completion_tokens: int) -> float:
    """The mean logprob of a completion choice's generated tokens (its echoed prompt's left out)."""
    if completion_tokens <= 0:
        return 0.0
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
    got = [x for x in lps[-completion_tokens:] if x is not None]
    return sum(got) / len(got) if got else float("-inf")


def best(parts: list[dict], n: int, best_of: int, keep_logprobs: bool) -> list[dict]:
    """Per prompt (``best_of`` consecutive parts), the ``n`` choices with the highest mean logprob,
    re-indexed in OpenAI's order; their logprobs dropped where the client did not ask for them."""
    choices = []
    for i in range(0, len(parts), best_of):
        group = parts[i : i + best_of]
        ranked = sorted(group, key=lambda r: -mean_logprob(r["choices"][0], r["usage"]["completion_tokens"]))
        for k, r in enumerate(ranked[:n]):
            c = dict(r["choices"][0], index=(i // best_of) * n + k)
            if not keep_logprobs:
                c["logprobs"] = None
            choices.append(c)
    return choices


def usage(n_prompt: int, n_out: int, cached: int | None) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when the node said how much its prefix cache gave
    and this request may know it (``SHOW_CACHED``)."""
    got = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if cached is not None and SHOW_CACHED.get():
        got["prompt_tokens_details"] = {"cached_tokens": cached}
    return got


def usage_of(n_prompt: int, outs: list[tuple[int, object, int | None]]) -> dict:
    """The usage of several choices, each ``(tokens out, its prompt, cached_tokens)``: every token out counts,
    and each prompt's cached tokens once (its choices share one prefill: the largest any of them reported)."""
    hits: dict[int, int] = {}
    for _, prompt, cached in outs:
        if cached is not None:
            hits[id(prompt)] = max(cached, hits.get(id(prompt), 0))
    return usage(n_prompt, sum(o[0] for o in outs), sum(hits.values()) if hits else None)


async def merged(parts: list, obj: str, rid: str, created: int, model: str, include_usage: bool, n_prompt: int,
                 counts: dict):  # fmt: skip
    """Several choices' SSE events as one stream, in arrival order; then usage (if asked) and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(events) -> None:
        try:
            async for e in events:
                await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(p)) for p in parts]
    try:
        left = len(tasks)
        while left:
            e = await queue.get()
            if e is None:
                left -= 1
            else:
                yield e
        if include_usage:
            usage = usage_of(n_prompt, list(counts.values()))
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:  # a client gone: each part's generator closes, aborting its nodes
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
