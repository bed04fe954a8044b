"""The gateway's HTTP surface: OpenAI-compatible /v1 API (several models: /v1/models lists them),
health, readiness, metrics; admin routes in ``admin``, internal ones in ``internal``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from compute.tokenizer import TemplateError

from . import choices, tools
from . import logprobs as lg
from . import protocol as p
from .activator import NotPlaced
from .admin import add_admin_routes
from .admission import Overloaded
from .auth import authorized, install_auth
from .internal import add_internal_routes
from .model_card import add_model_card_route
from .models import UnknownModel
from .nodes import RequestRejected
from .openapi import SSE, describe, errors
from .protocol import ChatCompletionRequest, CompletionRequest, error_body
from .relay import Unavailable
from .responses import add_responses_routes
from .service import REQUEST_SECONDS, REQUESTS, BadRequest, Delta, Gateway
from .tokens import add_token_routes

LEGACY_FIELDS = ("functions", "function_call")  # refused with their own message


class _JSON(JSONResponse):
    """JSON whose strings may hold a lone surrogate (JSON lets a client send "\\ud800"; an admin body or a
    message may echo it): written as the escape it came in as, never a 500 from the UTF-8 encoder."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")  # only a surrogate cannot be encoded, and only inside a string: "\\udXXX"


def _err(status: int, message: str, type_: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    REQUESTS.labels(str(status)).inc()
    return _JSON(error_body(message, type_, param, status), status_code=status, headers=headers)




def create_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="pdserve gateway", lifespan=lifespan, default_response_class=_JSON)
    cfg = gw.config

    def openapi() -> dict:
        """FastAPI's document, completed by ``openapi.describe`` with what this gateway serves."""
        if app.openapi_schema is None:
            bearer = {"api_key": ["/v1/", "/tokenize", "/detokenize"]} if cfg.api_keys else {}
            if not cfg.admin_open or cfg.admin_key:
                bearer["admin_key"] = ["/admin/"]
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            max_tokens, vocab, takes_tools = gw.document_limits()
            app.openapi_schema = describe(doc, gw.models.names, max_tokens, vocab, bearer, takes_tools)
        return app.openapi_schema

    app.openapi = openapi
    install_auth(app, cfg, _err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # a validator's own message
        if first.get("type") == "json_invalid":
            msg, loc = "request body is not valid JSON", None
        elif first.get("type") == "extra_forbidden" and loc in LEGACY_FIELDS:
            return _err(400, f"{loc}: deprecated by OpenAI and not supported: use tools and tool_choice",
                        param=loc)  # fmt: skip
        elif first.get("type") == "extra_forbidden":
            return _err(400, f"unknown field {loc!r}: pdserve does not implement it (docs/api.md lists the OpenAI "
                        "fields it honours, refuses and ignores)", param=loc)  # fmt: skip
        return _err(400, f"{loc + ': ' if loc else ''}{msg}", param=loc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Allow: every method of every route on this path (RFC 9110)
            methods = {m for r in app.router.routes if r.matches(request.scope)[0] != Match.NONE
                       for m in getattr(r, "methods", None) or ()}  # fmt: skip
            headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))}
        return _err(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error",
                    headers=headers)  # fmt: skip

    @app.get("/health", response_model=p.Health)
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses={200: {"model": p.Ready}, 503: {"model": p.Ready, "description": "no route to a node"}})
    async def ready():
        ok = gw.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load", response_model=p.Load)
    async def load():
        return {"queue_depth": gw.admission.waiting, "running": gw.admission.running,
                "queue_wait_p99_s": gw.admission.wait_p99(), "drain_rate_per_s": gw.admission.drain_rate()}  # fmt: skip

    @app.get("/v1/models", response_model=p.ModelList, responses=errors(401))
    async def models():
        await gw.models.refresh()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve"}
                                           for name in gw.models.names]}  # fmt: skip

    async def _text(name: str):
        """The model's text, or the 404 (not served) / 503 (its bundle unreadable now) to return."""
        try:
            return await gw.text(name)
        except UnknownModel as e:
            return _err(404, str(e), "not_found_error", "model")
        except Exception as e:  # noqa: BLE001 - the store failing is this request's 503, not the process's end
            return _err(503, f"model {name!r}: its tokenizer could not be read from the store: {e}", "server_error")

    generation_errors = errors(400, 401, 404, 429, 503)

    @app.post("/v1/chat/completions", responses={200: {"model": p.ChatCompletion, "content": SSE}, **generation_errors})
    async def chat(req: ChatCompletionRequest):
        if isinstance(text := await _text(req.model), JSONResponse):
            return text
        try:
            plan = tools.plan(req, text.bundle, text.name)
            prompt = gw.chat_prompt(text, tools.template_messages(req.messages), plan and plan.offered)
            if req.max_completion_tokens and req.max_tokens:  # both given: both are checked
                gw.check_len(text, prompt, req.max_tokens)
            max_tokens = gw.check_len(text, prompt, req.limit())
        except (BadRequest, TemplateError, ValueError) as e:
            return _err(400, str(e), param=getattr(e, "param", None))
        if req.n > 1:
            return await _respond_many(text, req, [prompt], [max_tokens], chat=True, plan=plan)
        return await _respond(text, req, prompt, max_tokens, chat=True, plan=plan)

    add_responses_routes(app, chat)  # /v1/responses, translated onto chat (gateway/responses/)
    add_model_card_route(app, gw)  # /v1/models/{model}
    add_token_routes(app, gw, lambda request: authorized(request, cfg.api_keys))  # /tokenize, /detokenize

    @app.post("/v1/completions", responses={200: {"model": p.Completion, "content": SSE}, **generation_errors})
    async def completions(req: CompletionRequest):
        if isinstance(text := await _text(req.model), JSONResponse):
            return text
        try:
            prompts = [p if isinstance(p, list) else text.bundle.encode(p) for p in req.prompts()]
            # max_tokens 0 (prompt scoring): the node makes one token, which is dropped
            limits = [gw.check_len(text, p, req.limit() or (1 if req.limit() == 0 else None), default=16)
                      for p in prompts]  # 16: the OpenAI default for completions  # fmt: skip
        except BadRequest as e:
            return _err(400, str(e), param=e.param)
        if len(prompts) == 1 and req.generated() == 1:
            return await _respond(text, req, prompts[0], limits[0], chat=False)
        return await _respond_many(text, req, prompts, limits, chat=False)

    async def _respond_many(text, req, prompts: list[list[int]], limits: list[int], chat: bool, plan=None):
        """Several choices (gateway/choices.py): a list of prompts, ``n`` per prompt, ``best_of``; each
        its own request, all at once; streamed, the choices' chunks interleave (each carries its index)."""
        rid, created, counts = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), {}
        best_of = req.generated() if not chat else req.n
        sub = req  # best_of ranks choices by their logprobs: asked of the nodes even if not of us
        if best_of > req.n and req.num_logprobs() is None:
            sub = req.model_copy(update={"logprobs": 0})
        todo = choices.jobs(prompts, limits, best_of, req.seed, rid)
        parts = await asyncio.gather(*(_respond(text, sub, j.prompt, j.limit, chat=chat, index=j.index, rid=rid,
                                                created=created, counts=counts, extra=j.params, affinity=j.affinity,
                                                plan=plan)
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
            n_out = sum(r["usage"]["completion_tokens"] for r in parts)
            hits: dict[int, int] = {}  # per prompt (its choices share one prefill): the largest hit reported
            for j, r in zip(todo, parts):
                c = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                if c is not None:
                    hits[id(j.prompt)] = max(c, hits.get(id(j.prompt), 0))
            usage = _usage(n_prompt, n_out, sum(hits.values()) if hits else None)
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": req.model, "choices": picked, "usage": usage}  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"
        return StreamingResponse(choices.merged(parts, obj, rid, created, req.model, req.include_usage, n_prompt,
                                                counts),
                                 media_type="text/event-stream")  # fmt: skip

    async def _respond(text, req, prompt: list[int], max_tokens: int, chat: bool, index: int = 0,
                       rid: str | None = None, created: int | None = None, counts: dict | None = None,
                       extra: dict | None = None, affinity=None, plan: tools.ToolPlan | None = None):  # fmt: skip
        """One choice. ``counts`` given: part of several (``_respond_many``): a stream comes back as its
        generator of SSE events (no usage, no [DONE]; its token count lands in ``counts[index]``);
        ``extra``: node params of this choice (seed, fork group); ``affinity``: its group's route;
        ``plan``: the tools offered (gateway/tools.py: their grammar, the calls parsed out of the answer)."""
        rid = rid or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = created or int(time.time())
        params, stops = replace(gw.node_params(req), **(extra or {})), req.stop_list()
        if plan is not None and plan.grammar is not None:
            params = replace(params, grammar=plan.grammar)
        timing: dict = {}
        t0 = time.monotonic()
        gen = gw.generate(text, prompt, max_tokens, params, stops, timing, affinity)
        try:  # the hold and admission happen before the first delta: surface 429/503 as plain HTTP errors
            first = await gen.__anext__()
        except Overloaded as e:
            await gen.aclose()
            return _err(429, str(e), "rate_limit_error", headers={"Retry-After": str(int(e.retry_after))})
        except NotPlaced as e:
            await gen.aclose()
            return _err(503, str(e), "server_error", headers={"Retry-After": str(int(e.retry_after))})
        except Unavailable as e:
            await gen.aclose()
            return _err(503, str(e), "server_error")
        except RequestRejected as e:  # the node refused the request itself: its message, not a 500
            await gen.aclose()
            bad = e.kind == "bad_request"
            return _err(400 if bad else 503, f"the node refused the request: {e}",
                        "invalid_request_error" if bad else "server_error")  # fmt: skip
        except StopAsyncIteration:
            return _err(503, "no output from the nodes", "server_error")
        echo = text.bundle.decode(prompt) if getattr(req, "echo", False) else ""
        lp = _Logprobs(text.bundle, req, chat, 0)
        if req.limit() == 0:  # nothing to generate: the node ran only for the prompt's logprobs
            first = await _scored_only(gen, first)
        calls = plan.parser() if plan is not None else None
        if req.stream:
            events = _sse(gen, first, rid, created, req, prompt, chat, t0, echo, lp, index, counts, calls)
            if counts is not None:
                return events
            return StreamingResponse(events,
                                     media_type="text/event-stream")  # fmt: skip
        out, n, reason = echo + first.text, len(first.token_ids), first.finish_reason
        logprobs = lp.merge(lp.prompt(prompt, first) if echo else None, lp.add(first))
        try:
            async for d in gen:
                out, n, reason = out + d.text, n + len(d.token_ids), d.finish_reason or reason
                logprobs = lp.merge(logprobs, lp.add(d))
        except (Unavailable, RequestRejected) as e:
            return _err(503, str(e), "server_error")
        finally:
            await gen.aclose()
        REQUESTS.labels("200").inc()
        REQUEST_SECONDS.observe(time.monotonic() - t0)
        usage = _usage(len(prompt), n, first.cached_tokens)
        if chat:
            message, reason = tools.message(calls, out, reason)
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
            return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [choice], "usage": usage}  # fmt: skip
        choice = {"index": index, "text": out, "logprobs": logprobs, "finish_reason": reason}
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [choice], "usage": usage}  # fmt: skip

    async def _sse(gen, first, rid, created, req, prompt: list[int], chat, t0, echo: str, lp: _Logprobs,
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
                counts[index] = n  # part of a batch: the merged stream ends it
                return
            if req.include_usage:
                yield chunk(usage=_usage(n_prompt, n, first.cached_tokens), choices=False)
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

    add_admin_routes(app, gw)  # /admin/*: nodes, status, the autoscaler's report (admin key)
    add_internal_routes(app, gw)  # /internal/*: the autoscaler's view and its reports (internal token)
    return app


def _usage(n_prompt: int, n_out: int, cached: int | None) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when the node said how much its prefix cache gave."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


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
