"""Chat chunks -> the Responses API's typed events, without processes: text then a call, an empty answer,
a node lost mid-stream (response.failed), and the chat stream closed when the events end."""

from __future__ import annotations

import asyncio
import json

from gateway.routes.responses.events import ResponseEvents
from gateway.routes.responses.protocol import ResponsesRequest


def chunk(content=None, reason=None, calls=None, usage=None) -> str:
    delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]} if usage is None else \
        {"choices": [], "usage": usage}  # fmt: skip
    return f"data: {json.dumps(body)}\n\n"


def run(chunks: list[str]) -> tuple[list[dict], bool]:
    closed = []

    async def source():
        try:
            for c in chunks:
                yield c
        finally:
            closed.append(True)

    async def main():
        req = ResponsesRequest(model="m", input="hi")
        out = [e async for e in ResponseEvents(req, "resp_1", 0).stream(source())]
        return [json.loads(e.split("data: ", 1)[1]) for e in out]

    return asyncio.run(main()), bool(closed)


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}


def test_text_then_a_call_then_completed_with_usage():
    events, closed = run([chunk(), chunk("Hel"), chunk("lo"), chunk(calls=[CALL], reason="tool_calls"),
                          chunk(usage=USAGE), "data: [DONE]\n\n"])  # fmt: skip
    assert closed and [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]  # fmt: skip
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][1]["call_id"] == "call_1"
    assert events[9]["output_index"] == 1 and events[9]["item"]["arguments"] == ""
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 3 and final["status"] == "completed"


def test_an_empty_answer_is_one_empty_message_and_length_is_incomplete():
    events, _ = run([chunk(), chunk(reason="length"), chunk(usage=USAGE)])
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(o["type"], o["status"], o["content"][0]["text"]) for o in final["output"]] == [("message", "incomplete", "")]


def test_a_node_lost_mid_stream_is_response_failed():
    err = 'data: {"error": {"message": "no node left", "type": "server_error", "param": null, "code": 503}}\n\n'
    events, closed = run([chunk("Hi"), err, "data: [DONE]\n\n"])
    assert closed and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "no node left"}
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
