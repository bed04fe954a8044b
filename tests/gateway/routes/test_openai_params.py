"""The OpenAI request fields pdserve honours, through the real `openai` client, on the real model: logprobs,
prompt scoring (echo + logprobs, max_tokens 0), penalties, logit_bias; and the strict refusals (unknown
fields, tools, structured output). The same requests run on a colocated node and on a prefill/decode
split: the prefill node computes the prompt's and the first token's logprobs, the decode node the rest,
and the results must agree. Numbers are compared between requests, nodes and batches, so every node runs
``kernels = invariant``, all on one plan (tests/services.py): under the default measured plan a request's
numbers may depend on its batch and on when a node swapped its plan in."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.services import AUTH, running_service

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
Q = [{"role": "user", "content": "List three primary colors."}]
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def both(tmp_path_factory, real_model_store):
    locations, name = real_model_store
    with running_service(tmp_path_factory.mktemp("both"), locations, name, ["both"], invariant=True) as svc:
        yield svc


@pytest.fixture(scope="module")
def split(tmp_path_factory, real_model_store):
    locations, name = real_model_store
    roles = ["prefill", "decode"]
    with running_service(tmp_path_factory.mktemp("split"), locations, name, roles, invariant=True) as svc:
        yield svc


def client(svc):
    return openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat_logprobs(svc, stream: bool) -> tuple[list[str], list]:
    kw = {"model": svc["name"], "messages": Q, "max_tokens": 12, "temperature": 0, "logprobs": True,
          "top_logprobs": 3}  # fmt: skip
    if not stream:
        r = client(svc).chat.completions.create(**kw)
        return [e.token for e in r.choices[0].logprobs.content], r.choices[0].logprobs.content
    content = []
    for ch in client(svc).chat.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            content += ch.choices[0].logprobs.content
    return [e.token for e in content], content


def test_chat_logprobs_same_streamed_split_and_colocated(both, split):
    tokens, content = _chat_logprobs(both, stream=False)
    assert 0 < len(content) <= 12
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        # greedy: the chosen token is a most likely one (the int8 runtime's bf16 logits tie now and then)
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.token in [t.token for t in e.top_logprobs if t.logprob == pytest.approx(e.logprob)]
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    for svc, stream in ((both, True), (split, False), (split, True)):
        got_tokens, got = _chat_logprobs(svc, stream)
        assert got_tokens == tokens
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_echo_scores_the_prompt_identically_split_and_colocated(both, split):
    """lm-evaluation-harness's loglikelihood request: the prompt as token ids, max_tokens 0, echo, logprobs 1."""
    ids = httpx.post(both["gw"].url + "/v1/completions", json={"model": both["name"], "prompt": TEXT,
                     "max_tokens": 1, "echo": True, "logprobs": 0}, timeout=60).json()  # fmt: skip
    assert ids["choices"][0]["text"].startswith(TEXT)
    scores = {}
    for name, svc in (("both", both), ("split", split)):
        r = client(svc).completions.create(model=svc["name"], prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
        ch = r.choices[0]
        assert ch.text == TEXT and r.usage.completion_tokens == 0
        lp = ch.logprobs
        assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
        assert "".join(lp.tokens) == TEXT and lp.text_offset[0] == 0
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
        scores[name] = lp.token_logprobs[1:]
    assert scores["split"] == pytest.approx(scores["both"], abs=1e-5)
    # the second "The quick brown fox" is far more likely than the first: the model read the first
    first, second = sum(scores["both"][1:4]), sum(scores["both"][-3:])
    assert second > first


@pytest.fixture(scope="module")
def bundle(real_model_store):
    from compute.modeling.tokenizer import TextBundle
    from paramstore import ParamStore, StoreConfig

    locations, name = real_model_store
    with ParamStore(StoreConfig(locations=locations)) as ps, ps.reader(ps.manifest(name)) as r:
        return TextBundle.from_files(r.bundle())


def test_penalties_and_logit_bias_change_the_answer_the_same_way_split(both, split, bundle):
    kw = {"model": both["name"], "prompt": bundle.encode(TEXT), "max_tokens": 16, "temperature": 0}
    c = client(both)
    plain = c.completions.create(**kw).choices[0].text
    penalized = c.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert penalized != plain
    split_penalized = client(split).completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert split_penalized.choices[0].text == penalized  # the decode node counts the prefill node's token too
    first = bundle.encode(TEXT + plain)[len(kw["prompt"])]  # the greedy next token (its id)
    banned = c.completions.create(**kw | {"max_tokens": 1}, logit_bias={str(first): -100})
    assert banned.choices[0].text and not plain.startswith(banned.choices[0].text)


def test_allowed_token_ids_restrict_the_answer_colocated_and_split(both, split, bundle):
    """vLLM's extension, end to end: the API model takes it, the node's engine masks every other token."""
    kw = {"model": both["name"], "prompt": bundle.encode(TEXT), "max_tokens": 8, "temperature": 0}
    allowed = bundle.encode(" red green blue")
    got = client(both).completions.create(**kw, extra_body={"allowed_token_ids": allowed})
    ids = bundle.encode(got.choices[0].text)
    assert ids and set(ids) <= set(allowed), (got.choices[0].text, allowed)
    split_got = client(split).completions.create(**kw, extra_body={"allowed_token_ids": allowed})
    assert split_got.choices[0].text == got.choices[0].text  # the prefill node's first token obeys it too
    r = httpx.post(both["gw"].url + "/v1/completions", json=kw | {"allowed_token_ids": [10**8]}, timeout=60)
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"], r.text
    r = httpx.post(both["gw"].url + "/v1/completions", json=kw | {"allowed_token_ids": []}, timeout=60)
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,needle", [
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "chat template does not render tools"),
    ({"functions": [{"name": "f"}]}, "functions: deprecated by OpenAI"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])  # fmt: skip
def test_what_is_not_implemented_is_refused_by_name(both, body, needle):
    r = httpx.post(both["gw"].url + "/v1/chat/completions",
                   json={"model": both["name"], "messages": Q, "max_tokens": 4} | body, timeout=60)  # fmt: skip
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    ok = httpx.post(both["gw"].url + "/v1/chat/completions",
                    json={"model": both["name"], "messages": Q, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
                          "store": False, "service_tier": "auto"}, timeout=60)  # fmt: skip
    assert ok.status_code == 200, ok.text  # IGNORED fields: accepted


def test_a_list_of_prompts_gets_one_choice_each_streamed_or_not(both, bundle):
    """One choice per prompt, in the list's order, streamed or not, the usage counted over all. That choice i
    answers prompt i is checked by its text: the node runs kernels = invariant, under which a prompt's greedy
    text in a batch of three is its text alone (the measured plan does not promise that: on the AMX Xeon it
    runs int8mm at M = 1 and oneDNN bf16 at M >= 8, and a continuation differed)."""
    texts = ["The capital of France is", "One, two, three,", "The quick brown fox"]
    c = client(both)
    one = [c.completions.create(model=both["name"], prompt=t, max_tokens=6, temperature=0).choices[0].text
           for t in texts]  # fmt: skip
    r = c.completions.create(model=both["name"], prompt=texts, max_tokens=6, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and [ch.text for ch in r.choices] == one
    assert all(ch.finish_reason in ("stop", "length") for ch in r.choices)
    assert r.usage.prompt_tokens == sum(len(bundle.encode(t)) for t in texts)
    ids = [bundle.encode(t) for t in texts]
    got = {0: "", 1: "", 2: ""}
    chunks = list(c.completions.create(model=both["name"], prompt=ids, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))  # fmt: skip
    for ch in chunks:
        for choice in ch.choices:
            got[choice.index] += choice.text
    assert [got[i] for i in range(3)] == one
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_structured_output_always_parses(both, split):
    """json_object for 20 prompts, a json_schema through the openai SDK's own helper (a pydantic model),
    a regex; split and colocated alike."""
    import json

    from pydantic import BaseModel

    c = client(both)
    asks = [f"Describe {x} as JSON." for x in ("a cat", "Paris", "the number 7", "a red car", "a book")] * 4
    def ask(i: int):
        return c.chat.completions.create(model=both["name"], messages=[{"role": "user", "content": asks[i]}],
                                         max_tokens=128, temperature=0.7, seed=i,
                                         response_format={"type": "json_object"}).choices[0]  # fmt: skip

    with ThreadPoolExecutor(len(asks)) as pool:  # all 20 at once: one batch on the node
        answers = list(pool.map(ask, range(len(asks))))
    done = [a for a in answers if a.finish_reason == "stop"]  # one cut by max_tokens cannot parse, grammar or not
    for a in done:
        assert isinstance(json.loads(a.message.content), dict), a.message.content
    for a in answers:
        assert a.message.content.startswith("{"), a.message.content
    print(f"json_object: {len(done)} of {len(asks)} answers complete within 128 tokens, all parsed")
    assert len(done) >= len(asks) // 2

    class City(BaseModel):
        name: str
        country: str
        population: int

    for svc in (both, split):
        got = client(svc).beta.chat.completions.parse(
            model=svc["name"], messages=[{"role": "user", "content": "Give me a city as JSON."}], max_tokens=64,
            temperature=0, response_format=City)  # fmt: skip
        assert isinstance(got.choices[0].message.parsed, City), got.choices[0].message.content
    r = c.completions.create(model=both["name"], prompt="My phone number is", max_tokens=12, temperature=0,
                             extra_body={"response_format": {"type": "regex", "pattern": " [0-9]{3}-[0-9]{4}"}})  # fmt: skip
    import re

    assert re.fullmatch(" [0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    bad = httpx.post(both["gw"].url + "/v1/chat/completions", json={"model": both["name"], "messages": Q,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
                     timeout=60)  # fmt: skip
    assert bad.status_code == 400 and "objectx" in bad.json()["error"]["message"], bad.text


def test_continuous_usage_stats_in_every_chunk(both):
    """vLLM's extension (guidellm sends it): each streamed chunk carries the usage so far."""
    chunks = list(client(both).chat.completions.create(
        model=both["name"], messages=Q, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert all(ch.usage is not None for ch in chunks) and counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens


def _prompt_computed(svc) -> float:
    """Prompt positions the service's nodes ran through the model so far (their /metrics, summed)."""
    total = 0.0
    for node in svc["nodes"]:
        for line in httpx.get(node.url + "/metrics", auth=AUTH, timeout=10).text.splitlines():
            if line.startswith(("pdserve_node_prompt_tokens_computed_total ", "pdserve_node_prompt_tokens_computed_total{")):
                total += float(line.split()[1])
    return total


def test_n_choices_share_one_prefill_are_seeded_and_reproducible(both, split, bundle):
    """n = 4 with a seed: 4 choices (indexed, different), the prompt computed once on a colocated node and
    on a split (then each fork's last 2 prompt tokens: +6), streamed alike; on the colocated node the same 4
    again, and the split draws the same 4: its decode node batches the 4 imports as they land, and under
    kernels = invariant (these nodes) a batch's size moves no logit (tests/compute/engine/test_fork.py checks each
    choice equals its seed's request alone, bit for bit)."""
    ids = bundle.encode(TEXT)
    kw = {"prompt": ids, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 4}
    drawn = []
    for svc in (both, split):
        c = client(svc)
        before = _prompt_computed(svc)
        r = c.completions.create(model=svc["name"], **kw)
        computed = _prompt_computed(svc) - before
        assert computed == len(ids) + 6, (len(svc["nodes"]), computed, len(ids))
        texts = [ch.text for ch in r.choices]
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and len(set(texts)) > 1, texts
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 32  # the prompt counted once
        got = {k: "" for k in range(4)}
        for ch in c.completions.create(model=svc["name"], **kw, stream=True):
            for choice in ch.choices:
                got[choice.index] += choice.text
        assert all(got.values()) and len(set(got.values())) > 1, got
        assert [got[k] for k in range(4)] == texts
        if svc is both:
            assert [ch.text for ch in c.completions.create(model=svc["name"], **kw).choices] == texts
        drawn.append(texts)
    assert drawn[1] == drawn[0]  # split == colocated
    chat = client(both).chat.completions.create(model=both["name"], messages=Q, max_tokens=8, temperature=1.0, seed=3,
                                                n=3)  # fmt: skip
    assert [ch.index for ch in chat.choices] == [0, 1, 2] and all(ch.message.content for ch in chat.choices)
    assert len({ch.message.content for ch in chat.choices}) > 1


def test_best_of_returns_the_choice_with_the_best_mean_logprob(both, bundle):
    """best_of 3, n 1 = the best of the 3 choices n = 3 gives with the same seed (by mean token logprob)."""
    c = client(both)
    kw = {"model": both["name"], "prompt": bundle.encode(TEXT), "max_tokens": 6, "temperature": 1.0, "seed": 11}
    three = c.completions.create(**kw, n=3, logprobs=0).choices
    means = [sum(ch.logprobs.token_logprobs) / len(ch.logprobs.token_logprobs) for ch in three]
    r = c.completions.create(**kw, best_of=3)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.choices[0].text == three[means.index(max(means))].text
    assert r.usage.completion_tokens == sum(len(ch.logprobs.token_logprobs) for ch in three)
    e = httpx.post(both["gw"].url + "/v1/completions", json=kw | {"best_of": 2, "stream": True}, timeout=60)
    assert e.status_code == 400 and "cannot be streamed" in e.json()["error"]["message"], e.text
    fewer = c.completions.create(**kw, n=3, best_of=2, logprobs=0)  # best_of below n counts as n
    assert [ch.index for ch in fewer.choices] == [0, 1, 2] and all(ch.text and ch.logprobs for ch in fewer.choices)
    assert fewer.usage.completion_tokens == sum(len(ch.logprobs.token_logprobs) for ch in fewer.choices)
    # the same seeded choices, whichever reached the node first (each choice is a node request of its own: the first
    # leads the prompt, the others fork; tests/compute/engine/test_fork.py::test_a_choice_is_the_same_whether_...)
    assert [ch.text for ch in fewer.choices] == [ch.text for ch in three]
