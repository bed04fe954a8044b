"""The OpenAI surface: ``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` (translated onto chat), and ``/tokenize`` / ``/detokenize``.

A route checks what only it can (the model is served, the prompt fits, the tools render) and hands the
answer to ``answer.Answers``; what every request needs (API keys) is middleware (``auth``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from compute.modeling.tokenizer import TemplateError
from gateway.api import protocol as p
from gateway.api import tools
from gateway.api.openapi import SSE, errors
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.models import UnknownModel
from gateway.routes.answer import Answers
from gateway.routes.auth import authorized
from gateway.routes.errors import error_reply
from gateway.routes.model_card import listed, model_card_router
from gateway.routes.responses import responses_router
from gateway.routes.tokens import token_router
from gateway.service import BadRequest, Gateway


def openai_router(gw: Gateway) -> APIRouter:
    router, answers = APIRouter(), Answers(gw)

    @router.get("/v1/models", response_model=p.ModelList, responses=errors(401))
    async def models():
        await gw.models.refresh()
        names = gw.models.names
        texts = await asyncio.gather(*(gw.models.text(n) for n in names), return_exceptions=True)  # read once each
        return {"object": "list", "data": [listed(n, t if not isinstance(t, BaseException) else None)
                                           for n, t in zip(names, texts)]}  # fmt: skip

    async def _text(name: str):
        """The model's text, or the 404 (not served) / 503 (its bundle unreadable now) to return."""
        try:
            return await gw.text(name)
        except UnknownModel as e:
            return error_reply(404, str(e), "not_found_error", "model")
        except Exception as e:  # noqa: BLE001 - the store failing is this request's 503, not the process's end
            return error_reply(503, f"model {name!r}: its tokenizer could not be read from the store: {e}",
                               "server_error")  # fmt: skip

    generation_errors = errors(400, 401, 404, 429, 503)

    @router.post("/v1/chat/completions", responses={200: {"model": p.ChatCompletion, "content": SSE},
                                                    **generation_errors})  # fmt: skip
    async def chat(req: ChatCompletionRequest):
        if isinstance(text := await _text(req.model), JSONResponse):
            return text
        try:
            plan = tools.plan(req, text.bundle, text.name)
            prompt = await gw.chat_prompt(text, tools.template_messages(req.messages), plan and plan.offered)
            if req.max_completion_tokens and req.max_tokens:  # both given: both are checked
                gw.check_len(text, prompt, req.max_tokens)
            max_tokens = gw.check_len(text, prompt, req.limit())
        except (BadRequest, TemplateError, ValueError) as e:
            return error_reply(400, str(e), param=getattr(e, "param", None))
        if req.n > 1:
            return await answers.respond_many(text, req, [prompt], [max_tokens], chat=True, plan=plan)
        return await answers.respond(text, req, prompt, max_tokens, chat=True, plan=plan)

    @router.post("/v1/completions", responses={200: {"model": p.Completion, "content": SSE}, **generation_errors})
    async def completions(req: CompletionRequest):
        if isinstance(text := await _text(req.model), JSONResponse):
            return text
        try:
            prompts = await asyncio.to_thread(lambda: [p if isinstance(p, list) else text.bundle.encode(p)
                                                       for p in req.prompts()])  # off the event loop
            # max_tokens 0 (prompt scoring): the node makes one token, which is dropped
            limits = [gw.check_len(text, p, req.limit() or (1 if req.limit() == 0 else None), default=16)
                      for p in prompts]  # 16: the OpenAI default for completions  # fmt: skip
        except BadRequest as e:
            return error_reply(400, str(e), param=e.param)
        if len(prompts) == 1 and req.generated() == 1:
            return await answers.respond(text, req, prompts[0], limits[0], chat=False)
        return await answers.respond_many(text, req, prompts, limits, chat=False)

    router.include_router(responses_router(chat))  # /v1/responses, translated onto chat (gateway/routes/responses/)
    router.include_router(model_card_router(gw))  # /v1/models/{model}
    router.include_router(token_router(gw, lambda request: authorized(request, gw.config.api_keys)))
    return router
