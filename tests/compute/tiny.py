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
