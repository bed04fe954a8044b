"""Model configuration: the subset of an HF ``config.json`` the engine implements.

``ModelConfig.from_hf(d)`` accepts Llama-family checkpoints (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM`` without a sliding window) and refuses,
with ``UnsupportedModel``, every field value that would change the math in a way
this engine does not implement. Both rope layouts are read: transformers 5
(``rope_parameters``) and 4 (``rope_theta`` + ``rope_scaling``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from compute.errors import UnsupportedModel

# architecture -> model_type; q/k/v bias of Qwen2 is fixed by the architecture
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is ``linear`` or ``llama3``."""

    rope_type: str
    factor: float  # positions are stretched by this factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: pre-training context

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise UnsupportedModel(f"rope_type {self.rope_type!r} is not supported (supported: {_ROPE_TYPES})")
        if not self.factor > 0:
            raise UnsupportedModel(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise UnsupportedModel("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(slots=True)
class ModelConfig:
    """Shape and math of a Llama-family decoder."""

    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # model width D
    intermediate_size: int  # FFN width F (SwiGLU)
    num_layers: int  # decoder layers
    num_heads: int  # query heads H
    num_kv_heads: int  # key/value heads (GQA: < H, MQA: 1)
    head_dim: int = 0  # per-head width; 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    max_position_embeddings: int = 2048  # longest context the model supports
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2, Llama attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama attention_bias only)
    model_type: str = "llama"  # informational: llama, qwen2, mistral
    eos_token_ids: tuple[int, ...] = field(default=())  # ids that end generation
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise UnsupportedModel(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """RoPE inverse frequencies ``[head_dim // 2]`` fp32 on ``device`` (None: torch's default), as
        transformers computes them (on the host, then moved: the same numbers on every device)."""
        return self._inv_freq_host().to(device)

    def _inv_freq_host(self) -> torch.Tensor:
        dim = self.head_dim
        host = torch.device("cpu")  # explicit: a model is built under ``torch.device("meta")``
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=host) / dim))
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        # llama3: long wavelengths divided by factor, short kept, medium interpolated
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` dict; ``UnsupportedModel`` for anything not implemented."""
        model_type = _model_type(d)
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModel(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise UnsupportedModel("mlp_bias=true is not supported")
        if d.get("quantization_config"):
            raise UnsupportedModel("pre-quantized HF checkpoints (quantization_config) are not supported")
        if int(d.get("pretraining_tp", 1) or 1) != 1:
            raise UnsupportedModel("pretraining_tp != 1 is not supported")
        _refuse_sliding_window(d, model_type)
        theta, scaling = _rope(d)
        num_heads = int(d["num_attention_heads"])
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            model_type=model_type,
            eos_token_ids=_ids(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
        )


def _model_type(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        unknown = [a for a in archs if a not in _ARCHITECTURES]
        if unknown:
            raise UnsupportedModel(
                f"architecture {unknown[0]!r} is not supported (supported: {sorted(_ARCHITECTURES)})"
            )
        return _ARCHITECTURES[archs[0]]
    model_type = d.get("model_type")
    if model_type not in _ARCHITECTURES.values():
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: llama, qwen2, mistral)")
    return model_type


def _refuse_sliding_window(d: dict[str, Any], model_type: str) -> None:
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModel(f"layer types {sorted(set(layer_types))} are not supported (only full_attention)")
    if model_type == "qwen2":
        used = bool(d.get("use_sliding_window", False))
    else:
        used = d.get("sliding_window") is not None
    if used:
        raise UnsupportedModel(f"sliding window attention (sliding_window={d.get('sliding_window')}) is not supported")


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4)."""
    params = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        params = {**params, **d["rope_scaling"]}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (supported: {_ROPE_TYPES})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    factor = float(params["factor"])
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or d.get("max_position_embeddings", 8192)
        ),
    )


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)
