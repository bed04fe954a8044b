"""``POST /v1/responses``: the Responses API's stateless core, served through the chat path.

Lifecycle of a request:
 1. validated (``protocol.ResponsesRequest``: unknown fields, hosted tools, non-text content, ``store``
    true and ``previous_response_id`` are 400s naming them);
 2. translated into the chat request that computes it (``translate.chat_request``);
 3. run by the chat-completions handler itself: template, tools, grammar, admission, relay, stops;
 4. its answer translated back: a chat completion into the response object (``translate.response``),
    a chat stream into typed events (``events.ResponseEvents``), a chat error into the same error with
    the Responses field names (``translate.error``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ValidationError

from compute.node.streaming import ClosingStreamingResponse
from gateway.api.openapi import SSE_TYPED, errors
from gateway.api.protocol import ChatCompletionRequest, error_response
from gateway.routes.responses import translate
from gateway.routes.responses.events import ResponseEvents
from gateway.routes.responses.protocol import ResponseObject, ResponsesRequest


def responses_router(chat: Callable[[ChatCompletionRequest], Awaitable]) -> APIRouter:
    """``chat``: the gateway's chat-completions handler (a dict, an error response, or a stream)."""
    router = APIRouter()

    @router.post("/v1/responses", responses={200: {"model": ResponseObject, "content": SSE_TYPED},
                                          **errors(400, 401, 404, 429, 503)})  # fmt: skip
    async def responses(req: ResponsesRequest):
        rid, created = translate.new_id("resp_"), int(time.time())
        try:
            creq = translate.chat_request(req)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            return error_response(400, f"the request cannot be served as a chat request: {first.get('msg', e)}")
        reply = await chat(creq)
        if isinstance(reply, ClosingStreamingResponse):
            events = ResponseEvents(req, rid, created).stream(reply.body_iterator)
            return ClosingStreamingResponse(events, media_type="text/event-stream")
        if isinstance(reply, Response):
            return translate.error(reply)
        return translate.response(req, reply, rid, created)

    return router
