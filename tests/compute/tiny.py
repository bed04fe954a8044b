"""A tiny random Llama for engine tests (no transformers needed)."""

from __future__ import annotations

import torch

from compute.modeling.config import ModelConfig
from compute.modeling.model import Transformer
from tests.conftest import tiny_llama_config


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
    from tests.compute.modeling.test_model_parity import int8_state

    host = tiny_model(seed=seed)
    m = Transformer.build(host.config, torch.float32)
    m.load_weights(int8_state({n: b for n, b in host.named_buffers() if b is not None}))
    for lin in m.kernel_modules():
        lin.use_kernels(("int8mm",) * 4)
    for a in m.modules():
        if isinstance(a, Attention):
            a.aligned = True
    return m
