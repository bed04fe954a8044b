"""One answer of the OpenAI API, from the relay's deltas to the client: a response body, or a stream of
SSE chunks (``data: {...}`` then ``data: [DONE]``), in the shape of the endpoint that asked (chat or
completions), with its logprobs, tool calls and usage; several choices (``n``, a list of prompts, ``best_of``)
as one response whose streamed chunks interleave.

Lifecycle of ``respond``: node params from the request -> ``Gateway.generate`` (hold, admission, relay) ->
the first delta (a 429/503/400 is still a plain HTTP error here) -> the body, or the stream, whose end
(finished, client gone, nodes lost) closes the generator, so the nodes get their abort."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi.responses import JSONResponse

from compute.node.streaming import ClosingStreamingResponse
from gateway.admission.control import Overloaded
from gateway.api import choices, tools
from gateway.api import logprobs as lg
from gateway.api.protocol import error_body
from gateway.routes.auth import salted
from gateway.routes.errors import error_reply
from gateway.routing.activator import NotPlaced
from gateway.routing.nodes import RequestRejected
from gateway.routing.relay import Unavailable
from gateway.service import REQUEST_SECONDS, REQUESTS, Delta, Gateway


class Answers:
    """The answers of one gateway (``gw``): ``respond`` for one choice, ``respond_many`` for several."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def respond_many(self, text, req, prompts: list[list[int]], limits: list[int], chat: bool, plan=None):
        """Several choices (gateway/api/choices.py): a list of prompts, ``n`` per prompt, ``best_of``; each
        its own request, all at once; streamed, the choices' chunks interleave (each carries its index)."""
        rid, created, counts = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), {}
        best_of = req.generated() if not chat else req.n
        sub = req  # best_of ranks choices by their logprobs: asked of the nodes even if not of us
        if best_of > req.n and req.num_logprobs() is None:
            sub = req.model_copy(update={"logprobs": 0})
        todo = choices.jobs(prompts, limits, best_of, req.seed, rid)
        parts = await asyncio.gather(*(self.respond(text, sub, j.prompt, j.limit, chat=chat, index=j.index, rid=rid,
                                                    created=created, counts=counts, extra=j.params,
                                                    affinity=j.affinity, plan=plan)
                                       for j in todo))  # fmt: skip
        failed = next((r for r in parts if isinstance(r, JSONResponse)), None)
        if failed is not None:
            for r in parts:
                if not isinstance(r, (JSONResponse, dict)):
                    await r.aclose()  # a stream not read: its generator's finally aborts the nodes
            return failed
        n_prompt = sum(map(len, prompts))  # each prompt once, however many choices it has (OpenAI)
        if not req.stream:
            picked = choices.best(parts, req.n, best_of, req.num_logprobs() is not None) if best_of > req.n \
                else [r["choices"][0] for r in parts]  # fmt: skip
            usage = choices.usage_of(n_prompt, [(r["usage"]["completion_tokens"], j.prompt,
                                                 r["usage"].get("prompt_tokens_details", {}).get("cached_tokens"))
                                                for j, r in zip(todo, parts)])  # fmt: skip
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": req.model, "choices": picked, "usage": usage}  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"
        events = choices.merged(parts, obj, rid, created, req.model, req.include_usage, n_prompt, counts)
        return ClosingStreamingResponse(events, media_type="text/event-stream")

    async def respond(self, text, req, prompt: list[int], max_tokens: int, chat: bool, index: int = 0,
                      rid: str | None = None, created: int | None = None, counts: dict | None = None,
                      extra: dict | None = None, affinity=None, plan: tools.ToolPlan | None = None):  # fmt: skip
        """One choice. ``counts`` given: part of several (``respond_many``): a stream comes back as its
        generator of SSE events (no usage, no [DONE]; its tokens out, prompt and cached tokens land in
        ``counts[index]``);
        ``extra``: node params of this choice (seed, fork group); ``affinity``: its group's route;
        ``plan``: the tools offered (gateway/api/tools.py: their grammar, the calls parsed out of the answer)."""
        rid = rid or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = created or int(time.time())
        grammar = plan.grammar if plan is not None else None
        params = self.gw.node_params(req, extra, grammar, salted(getattr(req, "cache_salt", None)), text.adapter)
        stops = req.stop_list()
        timing: dict = {}
        t0 = time.monotonic()
        gen = self.gw.generate(text, prompt, max_tokens, params, stops, timing, affinity)
        try:  # the hold and admission happen before the first delta: surface 429/503 as plain HTTP errors
            first = await gen.__anext__()
        except Overloaded as e:
            await gen.aclose()
            return error_reply(429, str(e), "rate_limit_error", headers={"Retry-After": str(int(e.retry_after))})
        except NotPlaced as e:
            await gen.aclose()
            return error_reply(503, str(e), "server_error", headers={"Retry-After": str(int(e.retry_after))})
        except Unavailable as e:
            await gen.aclose()
            return error_reply(503, str(e), "server_error")
        except RequestRejected as e:  # the node refused the request itself: its message, not a 500
            await gen.aclose()
            bad = e.kind == "bad_request"
            return error_reply(400 if bad else 503, f"the node refused the request: {e}",
                        "invalid_request_error" if bad else "server_error")  # fmt: skip
        except StopAsyncIteration:
            return error_reply(503, "no output from the nodes", "server_error")
        echo = text.bundle.decode(prompt) if getattr(req, "echo", False) else ""
        lp = _Logprobs(text.bundle, req, chat, 0)
        if req.limit() == 0:  # nothing to generate: the node ran only for the prompt's logprobs
            first = await _scored_only(gen, first)
        calls = plan.parser() if plan is not None else None
        if req.stream:
            events = self._sse(gen, first, rid, created, req, prompt, chat, t0, echo, lp, index, counts, calls)
            if counts is not None:
                return events
            return ClosingStreamingResponse(events, media_type="text/event-stream")
        out, n, reason = echo + first.text, len(first.token_ids), first.finish_reason
        logprobs = lp.merge(lp.prompt(prompt, first) if echo else None, lp.add(first))
        try:
            async for d in gen:
                out, n, reason = out + d.text, n + len(d.token_ids), d.finish_reason or reason
                logprobs = lp.merge(logprobs, lp.add(d))
        except (Unavailable, RequestRejected) as e:
            return error_reply(503, str(e), "server_error")
        finally:
            await gen.aclose()
        REQUESTS.labels("200").inc()
        REQUEST_SECONDS.observe(time.monotonic() - t0)
        usage = choices.usage(len(prompt), n, first.cached_tokens)
        if chat:
            message, reason = tools.message(calls, out, reason)
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
            return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [choice], "usage": usage}  # fmt: skip
        choice = {"index": index, "text": out, "logprobs": logprobs, "finish_reason": reason}
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [choice], "usage": usage}  # fmt: skip

    async def _sse(self, gen, first, rid, created, req, prompt: list[int], chat, t0, echo: str, lp: _Logprobs,
                   index: int = 0, counts: dict | None = None, calls: tools.CallParser | None = None):  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_prompt = len(prompt)

        def chunk(text=None, reason=None, role=False, usage=None, choices=True, logprobs=None, tool_calls=None):
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                ch = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                ch = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            body = {"id": rid, "object": obj, "created": created, "model": req.model,
                    "choices": [ch] if choices else []}  # fmt: skip
            if usage is None and req.continuous_usage:  # vLLM's extension: the usage so far, in every chunk
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        n = 0
        status = "200"
        try:
            if chat:
                yield chunk(role=True)
            elif echo:
                yield chunk(echo, logprobs=lp.prompt(prompt, first))
            d = first
            while True:
                n += len(d.token_ids)
                logprobs = lp.add(d)
                content, entries, reason = d.text, None, d.finish_reason
                if calls is not None:
                    content, entries, reason = tools.stream_delta(calls, d.text, d.finish_reason)
                if content or entries or reason or logprobs:
                    yield chunk(content, reason, logprobs=logprobs, tool_calls=entries)
                if d.finish_reason:
                    break
                d = await gen.__anext__()
            if counts is not None:
                counts[index] = (n, prompt, first.cached_tokens)  # part of a batch: the merged stream ends it
                return
            if req.include_usage:
                yield chunk(usage=choices.usage(n_prompt, n, first.cached_tokens), choices=False)
        except (Unavailable, RequestRejected) as e:
            status = "503"
            yield f"data: {json.dumps(error_body(str(e), 'server_error', code=503))}\n\n"
        except StopAsyncIteration:
            pass
        finally:
            await gen.aclose()  # a client that went away lands here too: nodes get their abort
            REQUESTS.labels(status).inc()
            REQUEST_SECONDS.observe(time.monotonic() - t0)
        yield "data: [DONE]\n\n"


async def _scored_only(gen, first):
    """``max_tokens: 0``: the one token the node made is dropped (its prompt logprobs kept), the stream closed."""
    await gen.aclose()
    return Delta("", [], "length", None, first.prompt_logprobs, first.cached_tokens)


class _Logprobs:
    """One response's logprobs in the shape its endpoint gives them (None when not asked for)."""

    def __init__(self, bundle, req, chat: bool, offset: int) -> None:
        self.bundle, self.chat = bundle, chat
        self.wanted = req.num_logprobs() is not None
        self.completion = None if chat else lg.CompletionLogprobs(bundle, offset)

    def prompt(self, prompt: list[int], first) -> dict | None:
        """An echoed prompt's logprobs (completions): the first token's is null."""
        if not self.wanted:
            return None
        plps = first.prompt_logprobs or [None] * len(prompt)
        return self.completion.add(prompt, plps)

    def add(self, d) -> dict | None:
        if not self.wanted or not d.token_ids:
            return None
        lps = d.logprobs or [None] * len(d.token_ids)
        if self.chat:
            return {"content": lg.chat_entries(self.bundle, d.token_ids, lps)}
        return self.completion.add(d.token_ids, lps)

    def merge(self, a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a or b
        return {"content": a["content"] + b["content"]} if self.chat else lg.merge(a, b)
