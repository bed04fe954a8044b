"""The decoder layer's shorter op sequences give bitwise the numbers of the longer ones they replaced.

Each fused form (compute/modeling/model.py, attention.py, kv_cache.py) is checked against the plain
formula it stands for, written out here as it was: a change of rounding anywhere would change greedy
answers on the real model, so equality is exact, not within a tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from compute.modeling.attention import _decode
from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import MLP, RMSNorm, apply_rope, rope_cos_sin
from tests.compute.tiny import quantize
from tests.conftest import tiny_llama_config


def _outliers(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Unit normal with a few channels 100x larger (as a residual stream has)."""
    x = torch.randn(*shape, generator=gen)
    x[..., torch.randperm(shape[-1], generator=gen)[:3]] *= 100.0
    return x


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 512])  # torch.rms_norm up to RMS_NORM_MAX_ROWS, in place beyond
def test_rms_norm_in_one_call_equals_the_formula(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.load("weight", 1 + 0.1 * torch.randn(576, generator=gen))
    x = _outliers(rows, 576, gen=gen)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), ref)
    # a bf16 runtime keeps the formula as transformers writes it (fp32 inside, rounded before the weight)
    nb = RMSNorm(576, 1e-5, torch.bfloat16)
    nb.load("weight", norm.weight)
    xb = x.to(torch.bfloat16)
    x32 = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(nb(xb), nb.weight * x32.to(torch.bfloat16))


@pytest.mark.parametrize("dtype,rope_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])  # int8, fp32, bf16 runtimes
def test_rope_roll_equals_the_concatenated_halves(dtype, rope_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 12, 64, generator=gen).to(dtype)
    keep = x.clone()
    inv_freq = 1.0 / (100000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(100, 109), rope_dtype)
    ref = x * cos + torch.cat((x[..., 32:], x[..., :32]), dim=-1) * sin
    assert torch.equal(apply_rope(x, cos, sin), ref)
    assert torch.equal(x, keep)  # its input untouched


def _decode_reference(q, cache, layer, d, scale):
    """The decode attention as it was: q scaled, bmm, masked_fill_ of the padded keys, softmax, bmm."""
    b, h, dh = q.shape
    kv = cache.gather_slots(layer, d.slots)
    n, kvh = kv.shape[2], kv.shape[3]
    kv32 = torch.empty((2, b * kvh, n, dh), dtype=torch.float32)
    kv32.view(2, b, kvh, n, dh).copy_(kv.transpose(2, 3))
    qg = (q.to(torch.float32) * scale).view(b * kvh, h // kvh, dh)
    s = torch.bmm(qg, kv32[0].transpose(1, 2))
    if d.mask is not None:
        s.view(b, kvh, -1, n).masked_fill_(~d.mask.view(b, 1, 1, n), float("-inf"))
    return torch.bmm(torch.softmax(s, -1), kv32[1]).view(b, h, dh).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp32: a rounding anywhere shows in the output
@pytest.mark.parametrize("head_dim", [64, 48])  # scale 1/8 (a power of two: inside the GEMM) and 1/sqrt(48)
@pytest.mark.parametrize("ctx", [[16, 16], [5, 40, 17], [33]])  # unpadded (no bias), padded, one stream padded
def test_decode_scores_with_bias_and_alpha_equal_masked_fill(dtype, head_dim, ctx):
    cfg = ModelConfig.from_hf(tiny_llama_config(layers=1, hidden=3 * head_dim, heads=3, kv_heads=1) | {"head_dim": head_dim})
    gen = torch.Generator().manual_seed(head_dim + len(ctx))
    cache = KVCache(cfg, 16, 16, dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(ctx))]
    d = ForwardBatch.build([[1]] * len(ctx), [c - 1 for c in ctx], tables, 16).decodes
    assert (d.mask is None) == (len(set(ctx)) == 1 and ctx[0] % 16 == 0)
    # q as the layer hands it over: a view of the rows of a q | k | v buffer (strided)
    q = torch.randn(len(ctx), 5, head_dim, generator=gen).to(dtype)[:, :3]
    scale = head_dim**-0.5
    assert (math.frexp(scale)[0] == 0.5) == (head_dim == 64)
    assert torch.equal(_decode(q, 0, cache, d, scale), _decode_reference(q, cache, 0, d, scale))
    assert torch.equal(_decode(q, 0, cache, d, scale), _decode_reference(q, cache, 0, d, scale))  # bias reused


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_write_kv_equals_writing_k_and_v_apart(kv_dtype):
    cfg = ModelConfig.from_hf(tiny_llama_config(layers=2))
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(5, 2 * cfg.num_kv_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)  # [T, 2 KVH, Dh]
    slots = torch.tensor([7, 0, 12, 3, 30])
    one, two = KVCache(cfg, 8, 4, kv_dtype), KVCache(cfg, 8, 4, kv_dtype)
    one.write_kv(1, slots, kv)
    two.write(1, slots, kv[:, : cfg.num_kv_heads], kv[:, cfg.num_kv_heads :])
    assert torch.equal(one.kv, two.kv) and one.kv[1].abs().sum() > 0 and one.kv[0].abs().sum() == 0


@pytest.mark.parametrize("rows", [1, 3, 70])  # int8mm (bf16 out) at M <= 64, dequant (fp32 out) beyond
def test_mlp_in_place_equals_silu_times_up(rows):
    cfg = ModelConfig.from_hf(tiny_llama_config(layers=1, hidden=64, ffn=128))
    gen = torch.Generator().manual_seed(rows)
    mlp = MLP(cfg, 0, torch.float32, 64)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        q, s = quantize(0.1 * torch.randn(lin.out_features, lin.in_features, generator=gen))
        lin.load("weight", q)
        lin.load("weight_scale", s)
    x = _outliers(rows, 64, gen=gen)
    gu = mlp.gate_up(x)  # both halves in x's dtype
    ref = mlp.down_proj(F.silu(gu[:, :128]) * gu[:, 128:], cast=False)
    assert torch.equal(mlp(x), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_score_bias_equals_sdpa_with_the_bool_mask(dtype):
    """A chunk of 100 queries after 12 cached tokens: SDPA given the step's additive bias computes what it computes
    from the bool mask (which it turns into that bias itself, on every layer)."""
    gen = torch.Generator().manual_seed(2)
    s = ForwardBatch.build([list(range(100))], [12], [list(range(7))], 16).prefills[0]
    q = torch.randn(1, 9, 100, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 3, s.mask.shape[1], 64, generator=gen).to(dtype) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, scale=0.125, enable_gqa=True)
    assert s.score_bias(dtype) is s.score_bias(dtype)  # made once
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=s.score_bias(dtype), scale=0.125,
                                                      enable_gqa=True), ref)  # fmt: skip
