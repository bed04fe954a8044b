"""The prefix cache as a user sees it, through the real `openai` client, real node processes and the real
model: a conversation's ``usage.prompt_tokens_details.cached_tokens`` grows turn by turn, a hit answers
what a miss answers (nodes under ``kernels = invariant``), a ``cache_salt`` shares nothing with another,
the node's metrics count queries and hits; and on a prefill/decode split the prefill node reports its hit."""

from __future__ import annotations

import uuid

import pytest

from tests.services import metric, running_service

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
QUESTIONS = ["Name a primary color.", "And another one?", "Which fruit is yellow?", "How many legs has a cat?",
             "What is two plus two?", "Say goodbye."]  # fmt: skip
BS = 16  # the nodes' default block size


SHOW = ("--report-cached-tokens", "always")  # keyless gateways: usage says cached_tokens only when told to


@pytest.fixture(scope="module")
def both(tmp_path_factory, real_model_store):
    locations, name = real_model_store
    with running_service(tmp_path_factory.mktemp("both"), locations, name, ["both"], invariant=True,
                         extra=SHOW) as svc:
        yield svc


@pytest.fixture(scope="module")
def split(tmp_path_factory, real_model_store):
    locations, name = real_model_store
    with running_service(tmp_path_factory.mktemp("split"), locations, name, ["prefill", "decode"],
                         invariant=True, extra=SHOW) as svc:  # fmt: skip
        yield svc


def client(svc):
    return openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(svc, messages: list[dict], **extra) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one greedy turn."""
    r = client(svc).chat.completions.create(model=svc["name"], messages=messages, max_tokens=12, temperature=0,
                                            extra_body=extra or None)  # fmt: skip
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_a_conversations_cached_tokens_grow_each_turn_and_a_hit_answers_as_a_miss(both):
    node = both["nodes"][0]
    hits0 = metric(node, "pdserve_node_prefix_cache_hits_total")
    messages = [{"role": "system", "content": f"You are a terse assistant (session {uuid.uuid4().hex})."}]
    turns = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        answer, prompt, cached = _ask(both, messages)
        turns.append((prompt, cached))
        messages.append({"role": "assistant", "content": answer})
    print(turns)
    assert turns[0][1] == 0  # a new session: nothing of it cached
    for (p0, c0), (p1, c1) in zip(turns, turns[1:]):
        assert c1 > c0 and c1 <= p1 - 2  # at least 2 prompt tokens computed (compute/engine/prefix_cache.py)
        assert c1 >= p0 // BS * BS - BS  # the previous turn's prompt, but for the block the answer's chunk may end
    # the last turn again, as a miss (another salt: no block in common): the same answer
    last = messages[:-1]
    hit = _ask(both, last)
    miss = _ask(both, last, cache_salt=uuid.uuid4().hex)
    assert hit[2] > 0 and miss[2] == 0 and hit[0] == miss[0] == messages[-1]["content"]
    assert metric(node, "pdserve_node_prefix_cache_hits_total") - hits0 >= sum(c for _, c in turns) + hit[2]
    assert metric(node, "vllm:prefix_cache_hits_total") == metric(node, "pdserve_node_prefix_cache_hits_total")
    assert metric(node, "pdserve_node_kv_blocks_cached") > 0


def test_a_salted_request_shares_only_with_its_own_salt(both):
    messages = [{"role": "user", "content": f"Spell the word {uuid.uuid4().hex[:8]} backwards, letter by letter."}]
    assert _ask(both, messages, cache_salt="tenant-a")[2] == 0
    assert _ask(both, messages, cache_salt="tenant-b")[2] == 0
    assert _ask(both, messages)[2] == 0
    assert _ask(both, messages, cache_salt="tenant-a")[2] > 0


def test_the_prefill_node_reports_its_hit_on_a_split(split):
    messages = [{"role": "system", "content": f"You answer in one word (session {uuid.uuid4().hex})."},
                {"role": "user", "content": "What color is the sky on a clear day?"}]  # fmt: skip
    first, second = _ask(split, messages), _ask(split, messages)
    assert first[2] == 0 and second[2] > 0 and first[0] == second[0]
    # the prefill node's hit, or the decode node's own when it held all but a few tokens (gateway/routing/router.py)
    assert sum(metric(n, "pdserve_node_prefix_cache_hits_total") for n in split["nodes"]) >= second[2]


def test_streamed_choices_report_their_prompts_cached_tokens_once(both):
    messages = [{"role": "user", "content": f"Count to three ({uuid.uuid4().hex[:8]})."}]
    _ask(both, messages)  # the prompt, cached
    stream = client(both).chat.completions.create(model=both["name"], messages=messages, max_tokens=4, n=2,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})  # fmt: skip
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 2
    cached = usage[0].prompt_tokens_details.cached_tokens
    assert 0 < cached <= usage[0].prompt_tokens - 2  # the one prompt's hit, not its choices' hits summed
