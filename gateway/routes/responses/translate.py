"""A Responses request as the gateway's chat request, and a chat completion back as a response object.

The Responses API is served on top of chat completions, not beside it: the same template, tool plan,
grammar, admission and relay. What maps to what:

  instructions                      a system message before the input
  input (text)                      one user message
  message item (role, text parts)   a message of that role, its parts' text joined
  function_call item                an assistant message's tool_calls entry (consecutive calls: one message)
  function_call_output item         a tool message answering that call_id
  max_output_tokens                 max_completion_tokens
  text.format                       response_format (json_schema, json_object: the grammar path)
  tools (flat function tools)       chat tools ({"type": "function", "function": {...}})
  tool_choice {"type", "name"}      {"type": "function", "function": {"name"}}

  choice.message.content            a message output item with one output_text part
  choice.message.tool_calls         one function_call output item each (call_id: the call's id)
  finish_reason "length"            status "incomplete", incomplete_details.reason "max_output_tokens"
  usage prompt/completion tokens    usage input/output tokens
"""

from __future__ import annotations

import json
import re
import uuid

from fastapi.responses import Response

from gateway.api.protocol import ChatCompletionRequest
from gateway.routes.responses.protocol import ResponsesRequest

# a chat field named in an error -> the Responses field the client sent
PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
          "response_format": "text.format"}  # fmt: skip
_NAMED = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that computes this response (pydantic ValidationError: cannot happen for a request
    that validated, but it is a 400 if it does)."""
    body: dict = {"model": req.model, "messages": chat_messages(req), "temperature": req.temperature,
                  "top_p": req.top_p, "stream": req.stream}  # fmt: skip
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the usage goes into response.completed
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]  # fmt: skip
    if isinstance(req.tool_choice, str):
        body["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    return ChatCompletionRequest.model_validate(body)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """instructions and input as chat messages (the module docstring's table)."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for item in req.input:
        if item.type == "message":
            out.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the answer's text, then its calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as a function_call output item."""
    return {"type": "function_call", "id": item_id or new_id("fc_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}  # fmt: skip


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}  # fmt: skip


def envelope(req: ResponsesRequest, rid: str, created: int, status: str, output: list[dict], usage_: dict | None,
             error: dict | None = None) -> dict:  # fmt: skip
    """The response object around its output: the request's settings as OpenAI echoes them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(req.tool_choice, str) \
        else (req.tool_choice or "auto")  # fmt: skip
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice, "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage_, "metadata": req.metadata or {}}  # fmt: skip


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response(req: ResponsesRequest, reply: dict, rid: str, created: int) -> dict:
    """An unstreamed chat completion -> the response object: its text (if any, or no call), then its calls."""
    choice = reply["choices"][0]
    msg, status = choice["message"], status_of(choice["finish_reason"])
    calls = msg.get("tool_calls") or []
    output = [message_item(msg["content"] or "", status)] if msg.get("content") or not calls else []
    output += [call_item(c) for c in calls]
    return envelope(req, rid, created, status, output, usage(reply["usage"]))


def error(reply: Response) -> Response:
    """The chat path's error as the Responses request's: its param (and the message's field names) renamed to
    the fields this request sent; status and Retry-After kept."""
    try:
        body = json.loads(reply.body)
        param = body["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return reply
    if param not in PARAMS and not _NAMED.search(body["error"]["message"]):
        return reply
    body["error"]["param"] = PARAMS.get(param, param)
    body["error"]["message"] = _NAMED.sub(lambda m: PARAMS[m.group(1)], body["error"]["message"])
    headers = {"Retry-After": reply.headers["retry-after"]} if "retry-after" in reply.headers else None
    # ASCII JSON: a lone surrogate the message echoes stays an escape
    return Response(json.dumps(body), status_code=reply.status_code, headers=headers, media_type="application/json")
