"""LoRA adapters served end to end: adapters made by PEFT on a tiny chat model, imported into the store beside it,
asked for by name through a real gateway and node with the ``openai`` client. The reference is transformers + PEFT
(unmerged, fp32, greedy) on the same weights: a node that ran the base, another adapter, or the base's cached KV
for an adapter's prompt would answer otherwise."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from pathlib import Path

import httpx
import pytest
import torch

from compute.node.launcher import Services
from tests.conftest import import_tiny_chat_models, tiny_chat_config, tiny_llama_tensors
from tests.lora import save_peft_adapter
from tests.services import TOKEN, node_generate, wait_for

pytestmark = pytest.mark.slow
MODEL = "tiny-lora-base"
ADAPTERS = {"tiny-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "tiny-mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"])}
STEPS = 12
CONTEXT = 512  # the tools template makes a chat prompt of ~240 tokens
TEMPLATE = str(Path(__file__).parents[2] / "deploy/chat-templates/chatml-tools.jinja")  # SmolLM2's, with tools


def _hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**tiny_chat_config(CONTEXT))).eval()
    hf.load_state_dict(tiny_llama_tensors(tiny_chat_config(CONTEXT), seed=0), strict=False)  # import_tiny_chat_models' seed 0
    return hf


@pytest.fixture(scope="module")
def svc(tmp_path_factory, real_model_store):
    from paramstore import ParamStore

    store = import_tiny_chat_models(tmp_path_factory, *real_model_store, (MODEL,), "lora-store", dtype="fp32",
                                    chat_template=TEMPLATE, context=CONTEXT)  # fmt: skip
    hf, dirs = _hf(), {}
    with ParamStore(store) as ps:
        for i, (name, options) in enumerate(ADAPTERS.items()):
            dirs[name] = tmp_path_factory.mktemp(name)
            save_peft_adapter(hf, options, dirs[name], seed=10 + i, std=0.3)
            ps.import_adapter(dirs[name], MODEL, name)
    services = Services(store.locations, None, str(tmp_path_factory.mktemp("lora")), TOKEN)
    try:
        flags = ("--weights", "fp32", "--step", "eager")
        node = services.node("both", kv_blocks=256, model=MODEL, extra=flags)
        prefill = services.node("prefill", kv_blocks=256, model=MODEL, extra=flags)
        decode = services.node("decode", kv_blocks=256, model=MODEL, extra=flags)
        conf = tmp_path_factory.mktemp("lora-conf") / "pdserve.toml"
        conf.write_text("[gateway]\nmodels_refresh_s = 1.0\n"  # a new adapter version is seen within a second
                        'report_cached_tokens = "always"\n')  # keyless: usage says cached_tokens when told to
        gw = services.gateway([("both", node)], env={"PDSERVE_CONFIG": str(conf)})
        split = services.gateway([("prefill", prefill), ("decode", decode)])
        for p in (node, prefill, decode, gw, split):
            p.wait_ready()
        gw.store = split.store = store
        yield {"node": node, "gw": gw, "split": split, "decode": decode, "store": store, "hf": hf, "dirs": dirs,
               "tmp": tmp_path_factory}  # fmt: skip
    finally:
        services.stop_all()


def _reference(hf, adapter_dir, ids: list[int], steps: int = STEPS) -> list[int]:
    """Greedy tokens of transformers (+ PEFT, unmerged, when ``adapter_dir``) recomputing the whole sequence."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval() if adapter_dir else hf
    out = list(ids)
    try:
        with torch.no_grad():
            for _ in range(steps):
                out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    finally:
        if adapter_dir:
            model.unload()
    return out[len(ids):]


def _text(gw, model: str, ids: list[int]) -> str:
    r = httpx.post(gw.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": STEPS,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model and body["usage"]["completion_tokens"] == STEPS
    return body["choices"][0]["text"]


def _decoded(gw, ids: list[int]) -> str:
    """The text of ``ids`` as an answer shows it (special tokens left out)."""
    from compute.modeling.tokenizer import TextBundle
    from paramstore import ParamStore

    global _BUNDLE
    if _BUNDLE is None:
        with ParamStore(gw.store) as ps, ps.reader(ps.manifest(MODEL)) as r:
            _BUNDLE = TextBundle.from_files(r.bundle())
    return _BUNDLE.decode(ids)


_BUNDLE = None


def test_each_adapter_answers_as_peft_does_and_the_base_as_itself(svc):
    hf, gw = svc["hf"], svc["gw"]
    ids = random.Random(1).choices(range(200, 40000), k=40)
    want = {None: _reference(hf, None, ids)} | {n: _reference(hf, svc["dirs"][n], ids) for n in ADAPTERS}
    want = {n: _decoded(gw, t) for n, t in want.items()}
    assert len(set(want.values())) == 3  # the adapters change the answer: the checks can fail
    # the base first: its prompt's blocks are cached on the node; an adapter must not be served from them
    assert _text(gw, MODEL, ids) == want[None]
    for name in ADAPTERS:
        assert _text(gw, name, ids) == want[name], name
    assert _text(gw, "tiny-qv", ids) == want["tiny-qv"]  # again: its own cached blocks, the same answer
    lora = svc["node"].load()["models"][MODEL]["lora"]
    assert sorted(lora["kept"]) == ["tiny-mlp@v1", "tiny-qv@v1"] and lora["running"] == [] and lora["loads"] == 2
    info = [line for line in httpx.get(svc["node"].url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]  # fmt: skip
    assert len(info) == 1 and 'max_lora="16"' in info[0] and 'running_lora_adapters=""' in info[0]


def test_mixed_requests_in_one_batch_each_get_their_own_answer(svc):
    hf, gw = svc["hf"], svc["gw"]
    prompts = [random.Random(10 + i).choices(range(200, 40000), k=24 + 5 * i) for i in range(6)]
    names = [MODEL, "tiny-qv", "tiny-mlp", "tiny-qv", MODEL, "tiny-mlp"]
    want = [_decoded(gw, _reference(hf, svc["dirs"].get(n), p)) for n, p in zip(names, prompts)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda a: _text(gw, *a), zip(names, prompts)))
    assert got == want


def test_split_prefill_and_decode_carry_the_adapter_through_the_kv_handoff(svc):
    """The prefill node computes the prompt's KV under the adapter, the decode node continues under it: both fetch
    it from the store on their first request; the answer is PEFT's."""
    hf, split = svc["hf"], svc["split"]
    ids = random.Random(7).choices(range(200, 40000), k=37)
    for name in ("tiny-mlp", MODEL, "tiny-qv"):
        assert _text(split, name, ids) == _decoded(split, _reference(hf, svc["dirs"].get(name), ids)), name
    metrics = httpx.get(svc["decode"].url + "/metrics", timeout=10).text
    assert 'pdserve_node_lora_lookups_total{model="tiny-lora-base",result="miss"} 2.0' in metrics


def test_models_lists_adapters_with_their_parent_and_the_openai_client_names_one(svc):
    from openai import OpenAI

    gw = svc["gw"]
    listed = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]}
    assert listed[MODEL]["parent"] is None and listed[MODEL]["root"] == MODEL
    assert listed["tiny-qv"]["parent"] == MODEL and listed["tiny-qv"]["root"] == "tiny-qv@v1"
    card = httpx.get(gw.url + "/v1/models/tiny-mlp", timeout=30).json()
    assert card["parent"] == MODEL and card["nodes_ready"] == 1  # runs on its base's node
    client = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="tiny-qv", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0)  # fmt: skip
    assert out.model == "tiny-qv" and out.usage.completion_tokens >= 1


def test_an_adapter_imported_while_serving_is_served_and_a_new_version_replaces_the_old(svc):
    from paramstore import ParamStore

    hf, gw, node = svc["hf"], svc["gw"], svc["node"]
    ids = random.Random(3).choices(range(200, 40000), k=33)
    first = svc["tmp"].mktemp("live-v1")
    save_peft_adapter(hf, dict(r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"]), first, seed=20, std=0.3)
    with ParamStore(svc["store"]) as ps:
        ps.import_adapter(first, MODEL, "tiny-live")
    old = _decoded(gw, _reference(hf, first, ids))
    listed = lambda: httpx.post(gw.url + "/v1/completions", json={"model": "tiny-live", "prompt": ids, "max_tokens": 1},
                                timeout=60).status_code != 404  # fmt: skip
    wait_for(listed, 10, "the new adapter listed")  # no restart: the next listing (or a miss's) finds it
    assert _text(gw, "tiny-live", ids) == old
    second = svc["tmp"].mktemp("live-v2")
    save_peft_adapter(hf, dict(r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"]), second, seed=21, std=0.3)
    with ParamStore(svc["store"]) as ps:
        ps.import_adapter(second, MODEL, "tiny-live")
    want = _decoded(gw, _reference(hf, second, ids))
    assert want != old
    got = wait_for(lambda: (t := _text(gw, "tiny-live", ids)) != old and t, 10, "v2 served after a listing")
    assert got == want  # v2's weights, and none of v1's cached KV
    loads = httpx.get(node.url + "/metrics", timeout=10).text
    assert 'pdserve_node_lora_load_seconds_count{model="tiny-lora-base"}' in loads


def test_a_gateway_serving_a_listed_model_serves_its_adapters_too(svc, tmp_path):
    """`pdserve up --model M` lists M: its adapters are served beside it, other models are not."""
    from gateway.models import ModelCatalogue
    from paramstore import ParamStore

    with ParamStore(svc["store"]) as ps:
        cat = ModelCatalogue(ps, [MODEL])
        assert cat.names == [MODEL]
        cat.relist()
        assert cat.names[0] == MODEL and {"tiny-qv", "tiny-mlp"} <= set(cat.names)
        other = ModelCatalogue(ps, ["some-other-model"])
        other.relist()
        assert other.names == ["some-other-model"]  # no adapter of it in the store


def test_an_adapter_with_n_logprobs_a_json_grammar_and_streaming(svc):
    """The request features run under an adapter as on the base: n > 1 (forked choices share the adapter's prompt
    KV), logprobs, a JSON grammar, a stream; greedy choices equal PEFT's answer."""
    hf, gw = svc["hf"], svc["gw"]
    ids = random.Random(11).choices(range(200, 40000), k=30)
    want = _decoded(gw, _reference(hf, svc["dirs"]["tiny-mlp"], ids))
    r = httpx.post(gw.url + "/v1/completions", json={"model": "tiny-mlp", "prompt": ids, "max_tokens": STEPS, "n": 2,
                                                     "temperature": 0, "ignore_eos": True, "logprobs": 2},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [want, want]
    assert all(len(c["logprobs"]["top_logprobs"]) == STEPS for c in choices)
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "tiny-qv", "max_tokens": 24, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}],
                                                          "response_format": {"type": "json_object"}},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.lstrip().startswith("{")  # the grammar held under the adapter (24 tokens may end mid-object)
    with httpx.stream("POST", gw.url + "/v1/completions", json={"model": "tiny-qv", "prompt": ids, "stream": True,
                                                                "max_tokens": STEPS, "temperature": 0,
                                                                "ignore_eos": True}, timeout=120) as s:  # fmt: skip
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                           if line.startswith("data: {"))  # fmt: skip
    assert streamed == _decoded(gw, _reference(hf, svc["dirs"]["tiny-qv"], ids))


WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}  # fmt: skip


def test_an_adapter_with_tools_the_responses_api_and_a_cache_salt(svc):
    """Under an adapter: the Responses API answers (as chat does), a required tool call is a valid call of the
    function, and a ``cache_salt`` shares cached prompt blocks only with its own salt (and never with the base)."""
    import jsonschema
    import openai

    c = openai.OpenAI(base_url=svc["gw"].url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather like in Paris today? Answer in one word."}]
    chat = c.chat.completions.create(model="tiny-mlp", messages=ask, max_tokens=STEPS, temperature=0)
    r = c.responses.create(model="tiny-mlp", input=ask, max_output_tokens=STEPS, temperature=0)
    assert r.model == "tiny-mlp" and r.output_text == chat.choices[0].message.content
    base = c.responses.create(model=MODEL, input=ask, max_output_tokens=STEPS, temperature=0)
    assert base.output_text != r.output_text  # the adapter ran, not the base
    call = c.responses.create(model="tiny-qv", input=ask, tools=[WEATHER], tool_choice="required",
                              parallel_tool_calls=False, temperature=0, max_output_tokens=64)  # fmt: skip
    assert [o.type for o in call.output] == ["function_call"] and call.output[0].name == "get_weather"
    jsonschema.validate(json.loads(call.output[0].arguments), WEATHER["parameters"])

    long = [{"role": "user", "content": "Tell me about the sea. " * 12}]

    def cached(model: str, salt: str) -> int:
        u = c.chat.completions.create(model=model, messages=long, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt}).usage  # fmt: skip
        return u.prompt_tokens_details.cached_tokens

    assert cached("tiny-qv", "tenant-a") == 0
    assert cached("tiny-qv", "tenant-b") == 0  # another salt: nothing shared
    assert cached(MODEL, "tenant-a") == 0  # the base under the same salt: not the adapter's KV
    assert cached("tiny-qv", "tenant-a") > 0  # its own salt and adapter: the prompt's blocks again


def test_an_adapters_requests_go_to_the_node_that_keeps_it(tmp_path_factory, svc):
    """Two idle `both` nodes, the adapter kept on the one the tie-break would not pick (the higher URL): the
    gateway's requests for it go there (the other would pay the fetch); checked failing with the fetch cost off."""
    from paramstore import ParamStore

    services = Services(svc["store"].locations, None, str(tmp_path_factory.mktemp("lora-route")), TOKEN)
    try:
        flags = ("--weights", "fp32", "--step", "eager")
        a, b = (services.node("both", kv_blocks=256, model=MODEL, extra=flags) for _ in range(2))
        gw = services.gateway([("both", a), ("both", b)])
        for p in (a, b, gw):
            p.wait_ready()
        gw.store = svc["store"]
        low, high = sorted((a, b), key=lambda n: n.url)
        with ParamStore(svc["store"]) as ps:
            ref = {"ref": "tiny-qv@v1", "digest": ps.manifest("tiny-qv@v1").adapter["digest"]}
        node_generate(high, "warm-1", [300, 301, 302], 2, adapter=ref)  # the adapter fetched there, not via the gateway
        lora = lambda n: n.load()["models"][MODEL].get("lora") or {}  # noqa: E731
        assert lora(high)["kept"] == ["tiny-qv@v1"]
        time.sleep(1.5)  # the gateway's next /load polls (every 0.5 s) see it
        for seed in range(5):  # one at a time: both nodes idle, only the adapter tells them apart
            _text(gw, "tiny-qv", random.Random(100 + seed).choices(range(200, 40000), k=20))
        assert lora(low).get("loads", 0) == 0 and lora(high)["loads"] == 1
        _text(gw, MODEL, [400, 401, 402])  # the base: the tie-break's node, as before
        assert low.load()["models"][MODEL]["prefix_queries"] > 0
    finally:
        services.stop_all()


def test_64_adapters_on_a_two_node_pool_all_answer_as_peft(svc, tmp_path_factory):
    """64 adapters (ranks 1-8, 4 at most kept per node: LRU evictions throughout) asked 16 at a time through the
    prefill + decode pool: none fails, each answers as transformers + PEFT with that adapter."""
    from paramstore import ParamStore

    hf, names, dirs = svc["hf"], [f"tiny-many-{i}" for i in range(64)], {}
    with ParamStore(svc["store"]) as ps:
        for i, name in enumerate(names):
            dirs[name] = svc["tmp"].mktemp(name)
            save_peft_adapter(hf, dict(r=1 + i % 8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                              dirs[name], seed=100 + i, std=0.3)  # fmt: skip
            ps.import_adapter(dirs[name], MODEL, name)
    services = Services(svc["store"].locations, None, str(tmp_path_factory.mktemp("lora-many")), TOKEN)
    try:
        flags = ("--weights", "fp32", "--step", "eager", "--max-loras", "4")
        prefill = services.node("prefill", kv_blocks=256, model=MODEL, extra=flags)
        decode = services.node("decode", kv_blocks=256, model=MODEL, extra=flags)
        gw = services.gateway([("prefill", prefill), ("decode", decode)])
        for p in (prefill, decode, gw):
            p.wait_ready()
        gw.store = svc["store"]
        ids = random.Random(64).choices(range(200, 40000), k=20)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = dict(zip(names, pool.map(lambda n: _text(gw, n, ids), names)))
        want = {n: _decoded(gw, _reference(hf, dirs[n], ids)) for n in names}
        assert got == want
        assert len(set(got.values())) > 32  # the adapters answer differently: each row ran its own
        kept = prefill.load()["models"][MODEL]["lora"]
        assert len(kept["kept"]) <= 4 and kept["loads"] >= 64
    finally:
        services.stop_all()
