"""Parity of compute.modeling.model with transformers on tiny random Llama/Qwen2 configs.

Every case runs: full-prompt prefill (all positions' logits), prefill in chunks
through a paged cache with scattered blocks, then 32 greedy decode steps; the
reference is transformers recomputing the whole sequence each step.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from compute.errors import UnsupportedModel, WeightMismatch
from compute.kernels.linear import Linear, dequantize
from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from tests.compute.tiny import int8_state, quantize

torch.set_num_threads(2)
TOL = 1e-4
BLOCK = 8
STEPS = 32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-gqa-untied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "llama-mqa-tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-bias-gqa-tied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "llama3-rope-mha-headdim32": (
        "llama",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "rope_scaling": LLAMA3_ROPE,
            "num_hidden_layers": 3,
        },
    ),
    "llama-attention-bias": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True}),
}


def make_hf(arch: str, **kw):
    """A tiny random transformers model (fp32, eval) and its config.json dict."""
    base = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": 0.1,
    }
    base.update(copy.deepcopy(kw))  # transformers edits rope dicts in place
    torch.manual_seed(1234)
    if arch == "qwen2":
        hc, cls, name = Qwen2Config(**base), Qwen2ForCausalLM, "Qwen2ForCausalLM"
    else:
        hc, cls, name = LlamaConfig(**base), LlamaForCausalLM, "LlamaForCausalLM"
    hf = cls(hc).eval()
    if arch == "qwen2":  # HF initializes biases to zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.2)
    d = json.loads(hc.to_json_string())
    d["architectures"] = [name]
    return hf, d


def ours(d: dict, state: dict, dtype=torch.float32) -> Transformer:
    m = Transformer.build(ModelConfig.from_hf(d), dtype)
    m.load_weights(state)
    assert m.ready, m.missing_weights()
    return m


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    arch, kw = CASES[request.param]
    hf, d = make_hf(arch, **kw)
    return hf, d, ours(d, hf.state_dict())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [S, V]


class PagedSeq:
    """A sequence with a scattered block table in its own cache, stepped by hand."""

    def __init__(self, cfg: ModelConfig, max_len: int, rng: random.Random, cache: KVCache | None = None):
        nb = -(-max_len // BLOCK)
        self.cache = cache or KVCache(cfg, nb * 2 + 3, BLOCK)
        self.table = rng.sample(range(self.cache.num_blocks), nb)
        self.len = 0

    def step(self, model: Transformer, tokens: list[int], all_logits=False) -> torch.Tensor:
        b = ForwardBatch.build([tokens], [self.len], [self.table], BLOCK, all_logits=all_logits)
        self.len += len(tokens)
        return model(b, self.cache)


def test_full_prefill_matches_hf(case):
    hf, d, m = case
    ids = random.Random(0).choices(range(d["vocab_size"]), k=45)
    seq = PagedSeq(m.config, len(ids), random.Random(1))
    got = seq.step(m, ids, all_logits=True)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 0.5  # logits are not trivially small
    assert (got - ref).abs().max() <= TOL


def test_chunked_prefill_then_greedy_decode_matches_hf(case):
    hf, d, m = case
    prompt = random.Random(2).choices(range(d["vocab_size"]), k=29)
    seq = PagedSeq(m.config, len(prompt) + STEPS, random.Random(3))
    for s, e in ((0, 5), (5, 6), (6, 19), (19, 29)):  # chunks crossing block boundaries
        got = seq.step(m, prompt[s:e], all_logits=True)
        assert (got - hf_logits(hf, prompt[:e])[s:e]).abs().max() <= TOL
    ids, mine, theirs, diffs = list(prompt), [], [], []
    for _ in range(STEPS):  # HF recomputes the whole sequence: the plainest reference
        ref = hf_logits(hf, ids)[-1]
        diffs.append(float((got[-1] - ref).abs().max()))
        mine.append(int(got[-1].argmax()))
        theirs.append(int(ref.argmax()))
        ids.append(mine[-1])
        got = seq.step(m, [mine[-1]])
    assert mine == theirs
    assert len(set(mine)) > 3  # not a degenerate constant output
    assert max(diffs) <= TOL


def test_mixed_batch_prefill_chunks_and_decodes(case):
    """One forward with a cached-prefix chunk, two decodes and a fresh prompt, sharing one cache."""
    hf, d, m = case
    rng = random.Random(4)
    cache = KVCache(m.config, 64, BLOCK)
    prompts = [rng.choices(range(d["vocab_size"]), k=n) for n in (21, 9, 17, 12)]
    free = rng.sample(range(64), 64)
    seqs = []
    for p in prompts:
        s = PagedSeq.__new__(PagedSeq)
        s.cache, s.table, s.len = cache, [free.pop() for _ in range(-(-len(p) // BLOCK))], 0
        seqs.append(s)
    # warm: seq0 caches 13 tokens, seq1 and seq2 all but their last token, seq3 nothing
    cached = [13, 8, 16, 0]
    for s, p, n in zip(seqs, prompts, cached):
        if n:
            s.step(m, p[:n])
    tokens = [p[n:] for p, n in zip(prompts, cached)]
    b = ForwardBatch.build(tokens, cached, [s.table for s in seqs], BLOCK)
    got = m(b, cache)  # [4, V]: last token of each
    for i, p in enumerate(prompts):
        assert (got[i] - hf_logits(hf, p)[-1]).abs().max() <= TOL


def test_weights_are_assigned_not_copied():
    hf, d = make_hf("llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    state = hf.state_dict()
    m = Transformer.build(ModelConfig.from_hf(d))
    assert all(b.is_meta for b in m.buffers())
    assert m.layers_loaded() == 0 and not m.ready
    first = {k: v for k, v in state.items() if ".layers.0." in k}
    m.load_weights(first)
    assert m.layers_loaded() == 1 and not m.ready
    m.load_weights(state)
    assert m.ready and m.layers_loaded() == 2
    o = m.model.layers[1].self_attn.o_proj.weight
    assert o.data_ptr() == state["model.layers.1.self_attn.o_proj.weight"].data_ptr()
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    # q/k/v (and gate/up) are copied once into one fused buffer; each HF name keeps a view of its rows
    attn = m.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        part = getattr(attn, name).weight
        assert torch.equal(part, state[f"model.layers.1.self_attn.{name}.weight"])
        assert part.untyped_storage().data_ptr() == attn.qkv.w.untyped_storage().data_ptr()
    assert torch.equal(attn.qkv.w, torch.cat([state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]))


def test_weight_errors():
    _hf, d = make_hf("llama", num_attention_heads=4, num_key_value_heads=2)
    m = Transformer.build(ModelConfig.from_hf(d))
    with pytest.raises(WeightMismatch, match="unknown tensor"):
        m.load_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(160, 64)})
    with pytest.raises(WeightMismatch, match="shape"):
        m.load_weights({"model.norm.weight": torch.zeros(65)})
    m.load_weights({"model.norm.weight": torch.ones(64)})
    b = ForwardBatch.build([[1, 2]], [0], [[0]], BLOCK)
    with pytest.raises(WeightMismatch, match="missing"):
        m(b, KVCache(m.config, 2, BLOCK))


# -- INT8 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m_rows", [1, 7, 64, 65, 130])
def test_int8_linear_equals_dequantized_linear(dtype, m_rows):
    torch.manual_seed(m_rows)
    w, b = torch.randn(96, 80), torch.randn(96)
    q, s = quantize(w)
    lin = Linear(80, 96, bias=True, dtype=dtype)
    lin.load("weight", q)
    lin.load("weight_scale", s)
    lin.load("bias", b)
    x = torch.randn(m_rows, 80).to(dtype)
    ref = F.linear(x.float(), dequantize(q, s), b)
    got = lin(x).float()
    assert got.dtype == torch.float32 and lin.weight.dtype == torch.int8
    rel = (got - ref).norm() / ref.norm()
    bf16_math = dtype == torch.bfloat16 or m_rows <= lin.int8mm_max_m  # int8mm takes bf16 input
    assert rel < (1e-2 if bf16_math else 1e-6), rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_model_close_to_fp32(dtype):
    hf, d = make_hf("llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    state = hf.state_dict()
    ref_model, q_model = ours(d, state), ours(d, int8_state(state), dtype)
    assert q_model.model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    assert q_model.model.embed_tokens.weight.dtype == torch.int8
    ids = random.Random(5).choices(range(d["vocab_size"]), k=80)
    rels = []
    for m_rows in (80, 1):  # prefill-sized (dequant path) then decode-sized (int8mm for bf16)
        ref = PagedSeq(ref_model.config, 80, random.Random(6)).step(ref_model, ids[:m_rows], all_logits=True)
        got = PagedSeq(q_model.config, 80, random.Random(6)).step(q_model, ids[:m_rows], all_logits=True)
        rels.append(float((got - ref).norm() / ref.norm()))
    assert max(rels) < 0.05, rels


# -- config --------------------------------------------------------------------------------


def _llama_dict(**kw) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
    }
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture"),
        ({"architectures": [], "model_type": "gemma"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding window"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096}, "sliding"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer types"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization"),
    ],
)
def test_unsupported_config_is_refused(patch, match):
    with pytest.raises(UnsupportedModel, match=match):
        ModelConfig.from_hf(_llama_dict(**patch))
    assert issubclass(UnsupportedModel, ValueError)


def test_config_reads_transformers4_and_5_rope_layouts():
    v4 = ModelConfig.from_hf(_llama_dict(rope_scaling=dict(LLAMA3_ROPE), eos_token_id=[7, 9]))
    v5 = ModelConfig.from_hf(_llama_dict(rope_theta=None, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}))
    assert v4.rope_scaling == v5.rope_scaling and v4.rope_theta == v5.rope_theta == 500000.0
    assert torch.equal(v4.inv_freq(), v5.inv_freq())
    assert v4.eos_token_ids == (7, 9) and v4.head_dim == 16 and not v4.qkv_bias
    qwen = ModelConfig.from_hf(_llama_dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096))
    assert qwen.qkv_bias and not qwen.o_bias
    mistral = ModelConfig.from_hf(_llama_dict(architectures=["MistralForCausalLM"], sliding_window=None))
    assert mistral.model_type == "mistral"
