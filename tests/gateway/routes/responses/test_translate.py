"""A Responses request as the chat request that computes it, and a chat error renamed to the fields the
Responses request sent (no processes)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from gateway.api.protocol import error_body
from gateway.routes.responses import translate
from gateway.routes.responses.protocol import ResponsesRequest


def test_items_become_chat_messages_and_settings_chat_fields():
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5,
        "input": [{"role": "user", "content": "Weather?"},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
                  {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}", "id": "fc_1"},
                  {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{\"a\":1}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"type": "function_call_output", "call_id": "call_2",
                   "output": [{"type": "input_text", "text": "rain"}]}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "w"}, "parallel_tool_calls": False})  # fmt: skip
    chat = translate.chat_request(req)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["content"] == "Let me check." and [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert (msgs[3]["tool_call_id"], msgs[3]["content"], msgs[4]["content"]) == ("call_1", "sunny", "rain")
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (7, 0, 0.5, False)
    assert chat.response_format.json_schema.schema_ == {"type": "object"} and chat.response_format.json_schema.name == "x"
    assert chat.tools[0].function.name == "w" and chat.tool_choice.function.name == "w"


def test_a_chat_error_names_the_responses_fields():
    reply = JSONResponse(error_body("the prompt has 9 and max_tokens asks for 99", param="max_tokens"), 400,
                         headers={"Retry-After": "3"})  # fmt: skip
    out = translate.error(reply)
    body = json.loads(out.body)["error"]
    assert (out.status_code, body["param"], out.headers["retry-after"]) == (400, "max_output_tokens", "3")
    assert body["message"] == "the prompt has 9 and max_output_tokens asks for 99"
    same = JSONResponse(error_body("no", param="tools"), 400)
    assert translate.error(same) is same
