"""HF transformers twins of our models, for parity tests."""

from __future__ import annotations

import torch


def hf_llama(config: dict, tensors: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM from an HF config dict and tensors (built on meta, assigned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # built on meta: rebuild its buffers
    return model.eval()
