"""Fused q/k/v and gate/up linears, and the per-step decode slot table."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from compute.errors import WeightMismatch
from compute.kernels.linear import FusedLinear, dequantize
from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from tests.compute.tiny import int8_state, quantize
from tests.conftest import tiny_llama_config, tiny_llama_tensors


def test_fused_linear_equals_its_parts_any_load_order():
    torch.manual_seed(0)
    fused = FusedLinear(48, (32, 16, 16), bias=True)
    ws = [torch.randn(n, 48) for n in (32, 16, 16)]
    bs = [torch.randn(n) for n in (32, 16, 16)]
    for i in (2, 0, 1):  # any order, one tensor at a time
        fused.parts[i].load("bias", bs[i])
        fused.parts[i].load("weight", ws[i])
    assert all(not p.missing() for p in fused.parts)
    x = torch.randn(5, 48)
    ref = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=1)
    assert torch.equal(fused(x), ref)
    assert torch.equal(fused.parts[1].weight, ws[1])  # each part sees its rows


@pytest.mark.parametrize("m_rows", [1, 65])
def test_fused_int8_equals_separate_int8(m_rows):
    torch.manual_seed(1)
    fused = FusedLinear(64, (96, 96), dtype=torch.float32)
    qs = [quantize(torch.randn(96, 64)) for _ in range(2)]
    for part, (q, s) in zip(fused.parts, qs):
        part.load("weight_scale", s)  # scale before weight is fine too
        part.load("weight", q)
    assert fused.parts[0].is_int8 and not fused.parts[0].missing()
    x = torch.randn(m_rows, 64)
    if m_rows == 1:  # int8mm with bf16 input: rows are independent, so fused == separate
        xb = x.to(torch.bfloat16)
        ref = torch.cat([torch.ops.aten._weight_int8pack_mm(xb, q, s.to(torch.bfloat16)) for q, s in qs], 1).float()
        assert torch.equal(fused(x), ref)
    else:
        ref = torch.cat([F.linear(x, dequantize(q, s)) for q, s in qs], 1)
        assert torch.equal(fused(x), ref)


def test_fused_parts_refuse_mixed_dtypes_and_bad_shapes():
    fused = FusedLinear(8, (4, 4))
    fused.parts[0].load("weight", torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(WeightMismatch, match="dtype"):
        fused.parts[1].load("weight", torch.zeros(4, 8))
    with pytest.raises(WeightMismatch, match="shape"):
        fused.parts[1].load("weight", torch.zeros(5, 8, dtype=torch.int8))


def test_missing_and_layers_loaded_track_fused_parts():
    cfg = tiny_llama_config(layers=2)
    tensors = tiny_llama_tensors(cfg)
    m = Transformer.build(ModelConfig.from_hf(cfg))
    names = [n for n, _ in m.named_buffers()]  # HF names only: the fused buffers are not buffers
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("qkv" in n or "gate_up" in n for n in names)
    m.load_weights({k: v for k, v in tensors.items() if "k_proj" not in k})
    assert not m.ready and m.layers_loaded() == 0
    assert sorted(m.missing_weights()) == [f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)]
    m.load_weights({k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" in k})
    assert m.layers_loaded() == 1 and not m.ready
    m.load_weights({k: v for k, v in tensors.items() if "k_proj" in k})
    assert m.ready and m.layers_loaded() == 2


def test_int8_model_in_pieces_equals_int8_model_at_once():
    cfg = tiny_llama_config(layers=2, tied=True)
    state = int8_state(tiny_llama_tensors(cfg, seed=3))
    whole = Transformer.build(ModelConfig.from_hf(cfg))
    whole.load_weights(state)
    pieces = Transformer.build(ModelConfig.from_hf(cfg))
    items = list(state.items())
    random.Random(0).shuffle(items)
    for i in range(0, len(items), 5):
        pieces.load_weights(dict(items[i : i + 5]))
    assert pieces.ready and pieces.lm_head.weight.data_ptr() == pieces.model.embed_tokens.weight.data_ptr()
    ids = list(range(3, 40))
    outs = []
    for m in (whole, pieces):
        cache = KVCache(m.config, 8, 8)
        outs.append(m(ForwardBatch.build([ids], [0], [[5, 1, 7, 2, 0]], 8, all_logits=True), cache))
    assert torch.equal(outs[0], outs[1])


def test_decode_slot_table_and_gather():
    cfg = ModelConfig.from_hf(tiny_llama_config(layers=2))
    cache = KVCache(cfg, 10, 4)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    tables = [[3, 7], [9], [1, 2, 4]]
    ctx = [6, 2, 9]  # after this step's token
    b = ForwardBatch.build([[1], [2], [3]], [c - 1 for c in ctx], tables, 4)
    d = b.decodes
    # keys padded to a multiple of KEY_MULTIPLE (16), masked past each context
    assert d.only and d.slots.shape == (3, 16) and d.mask.shape == (3, 1, 1, 16)
    assert d.slots[0, :6].tolist() == [12, 13, 14, 15, 28, 29] and d.slots[1, :2].tolist() == [36, 37]
    assert d.mask[:, 0, 0].sum(1).tolist() == ctx
    kv = cache.gather_slots(1, d.slots)  # [2, B, L, KVH, Dh]
    k_ref, v_ref = cache.gather(1, torch.tensor([1, 2, 4]))
    assert torch.equal(kv[0, 2, :9], k_ref[:9]) and torch.equal(kv[1, 2, :9], v_ref[:9])
    same = ForwardBatch.build([[1], [2]], [15, 15], [[3, 7, 5, 6], [1, 2, 8, 0]], 4).decodes
    assert same.mask is None  # nothing padded: both contexts are 16
    mixed = ForwardBatch.build([[1, 2, 3], [4]], [0, 5], [[3, 7], [1, 2]], 4).decodes
    assert not mixed.only and mixed.rows.tolist() == [3]


def test_dequantize_scratch_works_inside_and_outside_inference_mode():
    """The reused buffer is made in a fresh thread inside inference mode, then written outside it."""
    from concurrent.futures import ThreadPoolExecutor

    from compute.kernels.linear import dequantize_scratch

    q, s = torch.randint(-127, 128, (64, 32), dtype=torch.int8), torch.rand(64)

    def both():
        with torch.inference_mode():
            inside = dequantize_scratch(q, s).clone()
        return inside, dequantize_scratch(q, s).clone()

    with ThreadPoolExecutor(1) as pool:  # a new thread: its scratch buffer does not exist yet
        inside, outside = pool.submit(both).result()
    assert torch.equal(inside, dequantize(q, s)) and torch.equal(outside, inside)
