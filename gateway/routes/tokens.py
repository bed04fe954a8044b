"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer and chat template, shaped as
vLLM's server shapes them (clients count tokens against the model they will be charged by).

  /tokenize    {"model"?, "prompt", "add_special_tokens": true, "return_token_strs": false}
               or {"model"?, "messages", "add_generation_prompt": true, "add_special_tokens": false,
                   "tools"?, "return_token_strs": false}: the messages through the model's chat template,
               exactly as a chat completion renders them (its usage.prompt_tokens is this count)
               -> {"count", "max_model_len", "tokens", "token_strs"}
  /detokenize  {"model"?, "tokens"} -> {"prompt"} (special tokens kept: a rendered chat prompt comes back)

``model`` left out: the first served model (vLLM serves one). Guarded by the API keys as /v1 is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from starlette.responses import Response

from compute.modeling.tokenizer import TemplateError
from gateway.api import tools
from gateway.api.openapi import errors
from gateway.api.protocol import ChatMessage, Int, error_response
from gateway.api.tools import Tool
from gateway.models import UnknownModel

MAX_TOKENS = 1 << 20  # token ids in one /detokenize request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # unknown fields: 400 naming them


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own (a BOS where it adds one)
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes them; true adds the tokenizer's own as well
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # rendered as a chat request's
    return_token_strs: bool = False


def _form(v: Any) -> str:
    return "chat" if isinstance(v, dict) and "messages" in v else "prompt"


TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("prompt")]
                            | Annotated[TokenizeChatRequest, Tag("chat")], Discriminator(_form)]  # fmt: skip


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[Int(ge=0)], Field(max_length=MAX_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


def token_router(gw, authorized: Callable[[Request], bool]) -> APIRouter:
    """``authorized(request)``: whether the request carries a valid API key (checked only where keys are set)."""
    router = APIRouter()

    def denied(request: Request) -> Response | None:
        if gw.config.api_keys and not authorized(request):
            return error_response(401, "missing or invalid API key", "authentication_error")
        return None

    async def text_of(model: str | None):
        """The model's Text, or the error response to return."""
        name = model if model is not None else next(iter(gw.models.names), None)
        if name is None:
            return error_response(404, "this gateway serves no model yet", "not_found_error", "model")
        try:
            return await gw.text(name)
        except UnknownModel as e:
            return error_response(404, str(e), "not_found_error", "model")
        except Exception as e:  # noqa: BLE001 - the store failing is this request's 503
            return error_response(503, f"model {name!r}: its tokenizer could not be read from the store: {e}",
                                  "server_error")  # fmt: skip

    @router.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 401, 404, 503))
    async def tokenize(req: TokenizeRequest, request: Request):
        text = denied(request) or await text_of(req.model)
        if isinstance(text, Response):
            return text
        tok = text.bundle.tokenizer
        if isinstance(req, TokenizeChatRequest):
            offered = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            if offered and not tools.supported(text.bundle):
                return error_response(400, f"model {text.name!r}: its chat template does not render tools "
                                      f"({tools.TEMPLATE_HINT})", param="tools")  # fmt: skip
            try:
                prompt = await asyncio.to_thread(text.bundle.render_chat, tools.template_messages(req.messages),
                                                 req.add_generation_prompt, tools=offered)  # off the event loop
            except TemplateError as e:
                return error_response(400, str(e), param="messages")
        else:
            prompt = req.prompt
        ids = (await asyncio.to_thread(tok.encode, prompt, add_special_tokens=req.add_special_tokens)).ids
        strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": text.max_model_len, "tokens": ids, "token_strs": strs}

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 401, 404, 503))
    async def detokenize(req: DetokenizeRequest, request: Request):
        text = denied(request) or await text_of(req.model)
        if isinstance(text, Response):
            return text
        if any(t >= text.vocab_size for t in req.tokens):
            return error_response(400, f"a token id is out of the vocabulary (0 .. {text.vocab_size - 1})",
                                  param="tokens")  # fmt: skip
        return {"prompt": text.bundle.decode(req.tokens, skip_special_tokens=False)}

    return router
