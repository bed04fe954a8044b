"""gateway/api/tools.py: the checks a request's tools pass against the model's chat template, the call parser
(streamed in any chunks = unstreamed), and the grammar that forces calls, compiled by llguidance over
SmolLM2's real tokenizer and run token by token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from compute.modeling.tokenizer import TextBundle
from gateway.api import tools
from gateway.api.protocol import ChatCompletionRequest

TOOLS_TEMPLATE = Path(__file__).parents[3].joinpath("deploy/chat-templates/chatml-tools.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | kw)


def bundle(template: str | None) -> TextBundle:
    return TextBundle(None, template, ())


def parse_all(text: str, parallel: bool = True):
    msg, reason = tools.message(tools.CallParser(parallel), text, "stop")
    return msg, reason


def parse_streamed(text: str, cuts: list[int], parallel: bool = True):
    """The same text fed in pieces (cut at ``cuts``): content joined, calls in order, the last reason."""
    p, content, calls, reason = tools.CallParser(parallel), "", [], None
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for i, piece in enumerate(pieces):
        c, entries, reason = tools.stream_delta(p, piece, "stop" if i == len(pieces) - 1 else None)
        content += c
        calls += entries
    return content, calls, reason


def strip_ids(calls):
    return [{k: v for k, v in c.items() if k not in ("id", "index")} for c in calls]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "Just text, no call.",
    CALL,
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n",
    "<tool_call>\nnot json\n</tool_call> so it stays text",
    "a < b and <tool_c is not a call",
    '<tool_call>\n{"name": "get_time", "arguments": {}}',  # the answer ended inside the call
    "  \n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_in_any_pieces_equals_unstreamed(text):
    msg, reason = parse_all(text)
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
                                                   for _ in range(20)]  # fmt: skip
    for cuts in splits:
        content, calls, r = parse_streamed(text, cuts)
        assert content == (msg["content"] or "") and r == reason, cuts
        assert strip_ids(calls) == strip_ids(msg.get("tool_calls") or []), cuts
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_calls_are_parsed_into_the_api_shape():
    msg, reason = parse_all("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    msg, reason = parse_all(CALL)
    assert msg["content"] is None and reason == "tool_calls"
    msg, reason = parse_all('<tool_call>\n{"name": "get_time", "arguments": {}}')  # cut off: parsed as it stands
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_text_that_is_not_a_call_stays_verbatim_and_the_reason_is_kept():
    for text in ("<tool_call>\nnot json\n</tool_call> so it stays text", "a < b and <tool_c is not a call", "  \n"):
        msg, reason = parse_all(text)
        assert msg == {"role": "assistant", "content": text} and reason == "stop"
    msg, reason = tools.message(tools.CallParser(), CALL[:-3], "length")  # cut by max_tokens inside the marker
    assert reason == "length" and msg["content"] == CALL[:-3]


def test_parallel_false_keeps_the_first_call():
    msg, _ = parse_all(CALL + "\n" + CALL.replace("Paris", "Oslo"), parallel=False)
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == ["Paris"]
    content, calls, _ = parse_streamed(CALL + "\n" + CALL.replace("Paris", "Oslo"), [10, 90], parallel=False)
    assert len(calls) == 1 and content == ""


def test_no_parser_is_plain_text():
    assert tools.message(None, CALL, "stop") == ({"role": "assistant", "content": CALL}, "stop")


@pytest.mark.parametrize("kw,template,needle,param", [
    ({"tools": [WEATHER]}, "{{ messages }}", "does not render tools", "tools"),
    ({"tools": [WEATHER]}, None, "does not render tools", "tools"),
    ({"tools": [WEATHER]}, "{{ tools }}{{ messages }}", "not calls in a format pdserve parses", "tools"),
    ({"tools": [WEATHER, WEATHER]}, TOOLS_TEMPLATE, "same name", "tools"),
    ({"tool_choice": "auto"}, TOOLS_TEMPLATE, "tool_choice needs tools", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, TOOLS_TEMPLATE,
     "no tool is named 'nope'", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, TOOLS_TEMPLATE,
     "ask one", "response_format"),
])  # fmt: skip
def test_plan_refuses_what_the_model_or_request_cannot_do(kw, template, needle, param):
    with pytest.raises(tools.ToolError) as e:
        tools.plan(request(**kw), bundle(template), "m")
    assert needle in str(e.value) and e.value.param == param


def test_plan_per_tool_choice():
    b = bundle(TOOLS_TEMPLATE)
    assert tools.plan(request(), b, "m") is None and tools.plan(request(tool_choice="none"), b, "m") is None
    auto = tools.plan(request(tools=[WEATHER, TIME]), b, "m")
    assert auto.grammar is None and auto.parser() is not None and auto.offered == [WEATHER, TIME]
    none = tools.plan(request(tools=[WEATHER], tool_choice="none"), b, "m")
    assert none.parser() is None and none.grammar is None and none.offered == [WEATHER]
    required = tools.plan(request(tools=[WEATHER, TIME], tool_choice="required"), b, "m")
    assert required.grammar["type"] == "lark" and "get_time" in required.grammar["grammar"]
    named = tools.plan(request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       b, "m")  # fmt: skip
    assert "get_time" in named.grammar["grammar"] and "get_weather" not in named.grammar["grammar"]


def test_template_messages_give_the_template_objects():
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ])  # fmt: skip
    msgs = tools.template_messages(req.messages)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and msgs[1]["content"] == ""
    assert msgs[2] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    text = bundle(TOOLS_TEMPLATE).render_chat(msgs, tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18C\n</tool_response>" in text and json.dumps(WEATHER) in text
    assert bundle(TOOLS_TEMPLATE).template_uses("tools") and not bundle("{{ messages }}").template_uses("tools")


def _accepts(grammars, spec, text: str) -> bool:
    g, tok = grammars
    m = g.matcher(spec)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_forcing_grammar_admits_only_calls_of_the_chosen_tools(real_grammars):
    grammars = real_grammars
    req = request(tools=[WEATHER, TIME], tool_choice="required")
    spec = tools.plan(req, bundle(TOOLS_TEMPLATE), "m").grammar
    one = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _accepts(grammars, spec, one) and _accepts(grammars, spec, two)
    assert not _accepts(grammars, spec, "Sure! " + one)  # text first: no
    assert not _accepts(grammars, spec, one.replace("get_weather", "get_rain"))  # no such tool
    assert not _accepts(grammars, spec, one.replace('"city":"Paris"', '"days":3'))  # city is required
    assert not _accepts(grammars, spec, one.replace('"Paris"', '"Paris","wind":1'))  # no extra property
    single = tools.plan(request(tools=[WEATHER, TIME], parallel_tool_calls=False, tool_choice="required"),
                        bundle(TOOLS_TEMPLATE), "m").grammar  # fmt: skip
    assert _accepts(grammars, single, one) and not _accepts(grammars, single, two)
    named = tools.plan(request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       bundle(TOOLS_TEMPLATE), "m").grammar  # fmt: skip
    assert not _accepts(grammars, named, one) and _accepts(grammars, named, two[len(one) + 1 :])
    assert parse_all(two)[0]["tool_calls"][1]["function"] == {"name": "get_time", "arguments": "{}"}
