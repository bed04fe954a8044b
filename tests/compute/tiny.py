"""A tiny random Llama for engine tests (no transformers needed), its int8 and int4 twins, and the store's int8
quantization of a state dict."""

from __future__ import annotations

import torch

from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from paramstore.quant import quantize_int8
from paramstore.quant4 import quantize_int4
from tests.conftest import tiny_llama_config

quantize = quantize_int8  # the store's int8-absmax-per-row scheme: w ~= q * scale[:, None]


def int8_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if v.dim() == 2 and k.endswith("weight"):
            out[k], out[k + "_scale"] = quantize(v)
        else:
            out[k] = v
    return out


def tiny_model(seed: int = 0, std: float = 0.15, dtype=torch.float32, **overrides) -> Transformer:
    """Random weights large enough that greedy output is not constant."""
    cfg = tiny_llama_config(layers=2, vocab=300) | {"eos_token_id": None} | overrides
    config = ModelConfig.from_hf(cfg)
    g = torch.Generator().manual_seed(seed)
    model = Transformer.build(config, dtype)
    tensors = {}
    for name, buf in model.named_buffers():
        if buf is None or name.startswith("lm_head") and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(buf.shape, generator=g)
        else:
            tensors[name] = std * torch.randn(buf.shape, generator=g)
    model.load_weights(tensors)
    assert model.ready
    return model


def invariant_tiny_model(seed: int = 7) -> Transformer:
    """The tiny model on int8 weights with one row-invariant kernel (int8mm) at every M and position-aligned
    prefill queries: what ``kernels = invariant`` gives a node (a row's numbers independent of its batch and
    of its prefill chunking; tests/compute/engine/test_engine.py)."""
    from compute.modeling.model import Attention

    host = tiny_model(seed=seed)
    m = Transformer.build(host.config, torch.float32)
    m.load_weights(int8_state({n: b for n, b in host.named_buffers() if b is not None}))
    for lin in m.kernel_modules():
        lin.use_kernels(("int8mm",) * 4)
    for a in m.modules():
        if isinstance(a, Attention):
            a.aligned = True
    return m


def int8_tiny() -> Transformer:
    ref = tiny_model()
    model = Transformer.build(ref.config, torch.float32)
    model.load_weights(int8_state(dict(ref.state_dict())))
    return model


def int8_tiny_seed3():
    fp = tiny_model(seed=3)
    m = Transformer.build(fp.config)
    m.load_weights(int8_state({k: v for k, v in fp.state_dict().items() if v is not None}))
    assert m.ready and m.int8_shapes()
    return m


def int4_tiny():
    ref = tiny_model()
    tensors = {}
    for name, t in ((n, b) for n, b in ref.named_buffers() if b is not None):
        if ".layers." in name and t.dim() == 2:
            packed, scale, zero = quantize_int4(t)
            tensors |= {name: packed, name + "_scale": scale, name + "_zero": zero}
        else:
            tensors[name] = t
    model = Transformer.build(ref.config)
    model.load_weights(tensors)
    return model


def logits(model, ps: list[list[int]]) -> torch.Tensor:
    """Last-token logits of each prompt, all in one forward (M = total prompt tokens)."""
    tables = [[i * 8 + j for j in range(8)] for i in range(len(ps))]
    return model(ForwardBatch.build(ps, [0] * len(ps), tables, 8), KVCache(model.config, 8 * len(ps), 8))


def dequantized(model):
    """The same model with its int8 weights dequantized to fp32 (the reference)."""
    ref = Transformer.build(model.config)
    state = {}
    for k, v in model.state_dict().items():
        if v is None or k.endswith("_scale"):
            continue
        scale = model.state_dict().get(k + "_scale")
        state[k] = v.float() * scale[:, None] if scale is not None and v.dtype == torch.int8 else v
    ref.load_weights(state)
    return ref
