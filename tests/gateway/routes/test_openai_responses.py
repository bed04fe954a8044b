"""The rest of the OpenAI surface through the real `openai` client: the Responses API (equal to the same
request through chat completions, streamed or not; json_schema; a function call round trip), model
retrieval with its load state, and vLLM's /tokenize and /detokenize.

The node serves a tiny random Llama carrying SmolLM2's tokenizer and the tools template
(deploy/chat-templates/chatml-tools.jinja: SmolLM2's ChatML plus tools), so each request costs
milliseconds: what is tested is the gateway's translation, the tokenizer and template are real. Answers
are compared between requests: the node runs ``kernels = invariant`` (tests/services.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import import_tiny_chat_models
from tests.services import running_service

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

NAME = "tiny-tools"
KEY = "sk-responses"
TEMPLATE = str(Path(__file__).parents[3] / "deploy/chat-templates/chatml-tools.jinja")
Q = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, [NAME], "responses-store",
                                    chat_template=TEMPLATE, context=2048)  # fmt: skip
    with running_service(tmp_path_factory.mktemp("responses"), store.locations, NAME, ["both"],
                         env={"PDSERVE_API_KEYS": KEY}, invariant=True) as svc:  # fmt: skip
        yield svc


def client(svc):
    return openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(svc, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(svc["gw"].url + path, json=body, headers=headers, timeout=60)


def streamed(svc, **kw) -> tuple[list, str, list]:
    """(events, the text of the deltas, the function calls done) of a streamed Responses call."""
    events = list(client(svc).responses.create(**kw, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    calls = [(e.name, json.loads(e.arguments)) for e in events if e.type == "response.function_call_arguments.done"]
    return events, text, calls


def test_a_response_equals_the_same_chat_completion_streamed_or_not(svc):
    c = client(svc)
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "Answer briefly."},
                                                           {"role": "user", "content": Q}],
                                     max_completion_tokens=12, temperature=0)  # fmt: skip
    want, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
    kw = {"model": NAME, "instructions": "Answer briefly.", "input": Q, "max_output_tokens": 12, "temperature": 0}
    r = c.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == want and [o.type for o in r.output] == ["message"]
    assert r.status == ("incomplete" if reason == "length" else "completed")
    assert (r.incomplete_details is not None) == (reason == "length")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == chat.usage.total_tokens

    events, text, _ = streamed(svc, **kw)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if reason == "length" else "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert text == want and events[-1].response.output_text == want
    assert events[-1].response.usage.model_dump() == r.usage.model_dump()
    # a list of message items with text parts: the same prompt
    items = [{"role": "system", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": Q}]}]  # fmt: skip
    r2 = c.responses.create(**(kw | {"instructions": None, "input": items}))
    assert r2.output_text == want and r2.usage.input_tokens == r.usage.input_tokens


def test_json_schema_output_validates_and_the_sdk_parses_it(svc):
    c = client(svc)
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = c.responses.create(model=NAME, input="Where is it sunny?", text={"format": fmt}, max_output_tokens=96,
                           temperature=0)  # fmt: skip
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), CITY)
    _, text, _ = streamed(svc, model=NAME, input="Where is it sunny?", text={"format": fmt}, max_output_tokens=96,
                          temperature=0)  # fmt: skip
    assert text == r.output_text

    class City(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        sunny: bool

    parsed = c.responses.parse(model=NAME, input="Where is it sunny?", text_format=City, max_output_tokens=96,
                               temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, City)
    r = c.responses.create(model=NAME, input="JSON please", text={"format": {"type": "json_object"}},
                           max_output_tokens=96, temperature=0)  # fmt: skip
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_a_function_call_round_trip(svc):
    c = client(svc)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = {"model": NAME, "input": ask, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
          "temperature": 0, "max_output_tokens": 96}  # fmt: skip
    first = c.responses.create(**kw)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"], first
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the same call through chat completions, and streamed; the SDK's stream helper gets the final response
    chat = c.chat.completions.create(model=NAME, messages=ask, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=96)  # fmt: skip
    assert [(t.function.name, json.loads(t.function.arguments)) for t in chat.choices[0].message.tool_calls] == \
        [(call.name, json.loads(call.arguments))]  # fmt: skip
    _, text, calls = streamed(svc, **kw)
    assert (text, calls) == ("", [(call.name, json.loads(call.arguments))])
    with c.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert [(o.name, o.arguments) for o in final.output] == [(call.name, call.arguments)]
    # the output goes back as input with the call's result; tool_choice none: the model answers in text
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    second = c.responses.create(model=NAME, input=ask + first.output + [result], tools=[WEATHER], tool_choice="none",
                                temperature=0, max_output_tokens=8)  # fmt: skip
    assert [o.type for o in second.output] == ["message"] and second.output_text
    # the call and its result were rendered into the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_what_is_not_served_is_a_400_naming_it(svc):
    c = client(svc)
    base = {"model": NAME, "input": Q, "max_output_tokens": 4}
    cases = [({"store": True}, "store", "stateless"), ({"previous_response_id": "resp_1"}, "previous_response_id",
             "stateless"), ({"reasoning": {"effort": "low"}}, "reasoning", "unknown field"),
             ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
              "input.items.0.message.content.items.0", "input_image"),
             ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
             ({"tool_choice": "required"}, "tool_choice", "tools"),
             ({"include": ["message.output_text.logprobs"]}, "include", "not served"),
             ({"input": [{"type": "reasoning", "summary": []}]}, "input.items.0", "function_call_output items")]  # fmt: skip
    for extra, param, said in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**(base | extra))
        err = e.value.body
        assert err["param"].startswith(param) and said in err["message"], (extra, err)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(**(base | {"model": "nope"}))
    r = post(svc, "/v1/responses", base, key=None)
    assert r.status_code == 401
    r = c.responses.create(**(base | {"store": False, "metadata": {"a": "b"}, "user": "u", "truncation": "disabled",
                                   "include": []}))
    assert r.store is False and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_models_retrieve_with_load_state_and_404(svc):
    c = client(svc)
    m = c.models.retrieve(NAME)
    assert (m.id, m.object, m.owned_by) == (NAME, "model", "pdserve")
    extra = m.model_extra
    assert extra["nodes_ready"] == 1 and extra["nodes_loading"] == 0 and extra["servable_from_zero"] is False
    assert extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "does not exist" in e.value.body["message"]


def test_tokenize_detokenize_round_trip_and_the_chat_count(svc):
    c = client(svc)
    r = post(svc, "/tokenize", {"model": NAME, "prompt": "Hello, world! 123", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert post(svc, "/detokenize", {"model": NAME, "tokens": r["tokens"]}).json() == {"prompt": "Hello, world! 123"}
    assert post(svc, "/tokenize", {"prompt": "Hello, world! 123"}).json()["tokens"] == r["tokens"]  # model: the first

    messages = [{"role": "user", "content": Q}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    t = post(svc, "/tokenize", {"model": NAME, "messages": messages}).json()
    assert t["count"] == chat.usage.prompt_tokens
    rendered = post(svc, "/detokenize", {"model": NAME, "tokens": t["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n") and Q in rendered
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = c.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=1, temperature=0)
    assert post(svc, "/tokenize", {"model": NAME, "messages": messages, "tools": tools}).json()["count"] == \
        chat.usage.prompt_tokens  # fmt: skip

    assert post(svc, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert post(svc, "/tokenize", {"model": NAME, "prompt": "x"}, key=None).status_code == 401
    bad = post(svc, "/tokenize", {"model": NAME, "prompt": "x", "chat_template": "{{ 1 }}"})
    assert bad.status_code == 400 and "chat_template" in bad.json()["error"]["message"]
    bad = post(svc, "/detokenize", {"model": NAME, "tokens": [49152]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
