"""kill -9 of the prefill node while it computes a prompt: the gateway retries on the other prefill
node and the client gets the same answer (real nodes, the real model, the real `openai` client). The
answer after the retry comes from another node: the nodes run ``kernels = invariant``, all on one plan
(tests/services.py)."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.services import running_service, wait_blocks_free

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
API_KEY = "sk-test-key"
def messages(items: int) -> list[dict]:
    """A long prompt (48 items: ~600 tokens), so its prefill runs long enough to be killed in the middle."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'white'][i % 4]} box holds {i % 7} marbles."
                    for i in range(items))  # fmt: skip
    return [{"role": "user", "content": text + " Which box holds the most marbles?"}]


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    locations, name = real_model_store
    with running_service(tmp_path_factory.mktemp("gw-failover"), locations, name, ["prefill", "prefill", "decode"],
                         env={"PDSERVE_API_KEYS": API_KEY}, invariant=True) as svc:  # fmt: skip
        yield svc


def _prefill_retries(gw) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    m = re.search(r'^pdserve_gateway_retries_total\{phase="prefill"\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_kill_prefill_mid_prompt_retries_on_the_other_prefill_node(svc):
    c = openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key=API_KEY, max_retries=0, timeout=180)
    prefills = svc["nodes"][:2]
    # the controls, in this run: how long the prompt's prefill runs (time to the first streamed token) and
    # one look at the nodes' load; the look must be short against the prefill (it is repeated at a fraction of
    # it, so the kill lands mid-prefill): on a machine where it is not, the prompt is made longer until it is
    items, context = 48, 8192 - 64

    def fresh() -> dict:  # each request its own cache salt: every one computes its whole prompt (no prefix hit)
        return {"extra_body": {"cache_salt": uuid.uuid4().hex}}

    while True:
        kw = {"model": svc["name"], "messages": messages(items), "max_tokens": 16, "temperature": 0}
        t0 = time.monotonic()
        with c.chat.completions.create(stream=True, **kw, **fresh()) as stream:
            next(ch for ch in stream if ch.choices and ch.choices[0].delta.content)
        prefill_s = time.monotonic() - t0
        t0 = time.monotonic()
        for n in prefills:
            n.load()
        look_s = time.monotonic() - t0
        if look_s < prefill_s / 5:
            break
        tokens = c.chat.completions.create(**kw | {"max_tokens": 1}, **fresh()).usage.prompt_tokens
        why = f"a look ({look_s:.3f} s) is long against the prefill of {tokens} tokens ({prefill_s:.3f} s)"
        assert 2 * tokens < context, why
        items *= 2
    want = c.chat.completions.create(**kw, **fresh()).choices[0].message.content
    retries = _prefill_retries(svc["gw"])
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: c.chat.completions.create(**kw, **fresh()))
        victim, deadline = None, time.monotonic() + 60
        while victim is None:
            assert time.monotonic() < deadline and not pending.done(), "no prefill node ever ran the prompt"
            busy = [n for n in prefills if n.load()["active_requests"] > 0]
            victim = busy[0] if busy else None
            time.sleep(prefill_s / 50)
        victim.kill9()  # mid-prefill: the gateway's call to it fails with a dropped connection
        got = pending.result(timeout=180)
    assert got.choices[0].message.content == want
    assert _prefill_retries(svc["gw"]) == retries + 1  # it was the prefill call that failed and was retried
    survivor = [n for n in svc["nodes"] if n is not victim]
    assert all(ld["kv_blocks_used"] == 0 for ld in wait_blocks_free(survivor, timeout=15))
