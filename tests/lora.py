"""PEFT adapters for tests, made by PEFT itself (``get_peft_model`` + ``save_pretrained``) on a transformers model."""

from __future__ import annotations

import torch


def save_peft_adapter(hf, options: dict, path, seed: int, std: float = 0.2) -> None:
    """Save a LoRA adapter of ``hf`` with random A and B (PEFT starts B at zero: the update would be nothing) to
    ``path`` as PEFT writes it; ``hf`` is left without the adapter's layers."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(hf, LoraConfig(**{"lora_dropout": 0.0, "bias": "none", **options}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    peft.save_pretrained(str(path))
    peft.unload()
