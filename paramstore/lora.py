"""A PEFT LoRA adapter, read and checked against its base model: what the store keeps and a node applies.

Input: a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, as ``save_pretrained`` writes
it) and the base's HF ``config.json``. Output: a ``LoraAdapter``, per targeted linear ``(layer, proj)`` the pair
``A [r, K]`` and ``B [N, r]`` (fp32) and its scaling, so that the linear computes ``W x + scaling * B (A x)``.

The scaling is PEFT's: ``alpha / r``, or ``alpha / sqrt(r)`` under ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` override ``r`` and ``lora_alpha`` per module, their keys matched as PEFT matches them
(``(.*\\.)?KEY$`` against ``model.layers.L.self_attn.q_proj``). The rank itself is read from the tensors.

What a node cannot apply is refused here, one line naming it (``UnservableAdapter``), never dropped: DoRA,
``modules_to_save``, a bias other than ``none``, a target other than the decoder layers' seven linears
(embeddings, ``lm_head``), a layer or shape the base does not have, an A without its B.

Canonical tensor names (how the store keeps them, whatever PEFT called them; layer-aligned as a model's are):
``model.layers.L.PROJ.lora_A`` ``[r, K]`` and ``model.layers.L.PROJ.lora_B`` ``[N, r]``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidRequest

# PEFT's names of a Llama-family decoder layer's linears -> their parent module
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_SUPPORTED_TYPES = {"LORA"}


class UnservableAdapter(InvalidRequest):
    """This adapter cannot be served as it is: the message names what (re-export it without that)."""


@dataclass(slots=True)
class LoraTarget:
    layer: int
    proj: str  # q_proj ... down_proj
    a: torch.Tensor  # [r, K] fp32
    b: torch.Tensor  # [N, r] fp32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def key(self) -> str:
        return f"model.layers.{self.layer}.{self.proj}"


@dataclass(slots=True)
class LoraAdapter:
    targets: list[LoraTarget]
    config: dict  # adapter_config.json as read (the card shows it)

    @property
    def ranks(self) -> list[int]:
        return sorted({t.rank for t in self.targets})

    @property
    def target_modules(self) -> list[str]:
        return sorted({t.proj for t in self.targets})

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for t in self.targets)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The canonical tensors (see the module's docstring)."""
        out = {}
        for t in self.targets:
            out[f"{t.key}.lora_A"] = t.a
            out[f"{t.key}.lora_B"] = t.b
        return out

    def scalings(self) -> dict[str, float]:
        return {t.key: t.scaling for t in self.targets}

    def digest(self) -> str:
        """Content hash (sha256 of the scalings and every tensor's bytes, in name order): what names this adapter
        in prefix-cache hashes, so a re-imported adapter never reuses another version's KV."""
        h = hashlib.sha256(json.dumps(self.scalings(), sort_keys=True).encode())
        for name, t in sorted(self.tensors().items()):
            h.update(name.encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    @classmethod
    def from_canonical(cls, tensors: dict[str, torch.Tensor], scalings: dict[str, float], config: dict) -> LoraAdapter:
        """Back from the store's canonical form (``tensors()`` and ``scalings()``)."""
        targets = []
        for key, scaling in sorted(scalings.items()):
            _, _, layer, proj = key.split(".")
            targets.append(LoraTarget(int(layer), proj, tensors[f"{key}.lora_A"], tensors[f"{key}.lora_B"], scaling))
        return cls(targets, config)


def base_shapes(base: dict) -> dict[str, tuple[int, int]]:
    """``(N, K)`` of each targetable linear of the base (an HF config.json)."""
    d, f = base["hidden_size"], base["intermediate_size"]
    h = base["num_attention_heads"]
    dh = base.get("head_dim") or d // h
    q, kv = h * dh, base.get("num_key_value_heads", h) * dh
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}  # fmt: skip


def read_peft(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT directory's config and tensors (safetensors only: a pickle is code, never loaded)."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg_path, st_path = p / "adapter_config.json", p / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise UnservableAdapter(f"{p}: no adapter_config.json (a PEFT adapter directory is needed)")
    if not st_path.is_file():
        raise UnservableAdapter(f"{p}: no adapter_model.safetensors (adapter_model.bin is a pickle: re-save "
                                "with safe_serialization=True)")  # fmt: skip
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UnservableAdapter(f"{cfg_path}: not JSON ({e})") from None
    try:
        tensors = load_file(str(st_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
        raise UnservableAdapter(f"{st_path}: unreadable ({e})") from None
    return config, tensors


def _pattern_value(patterns: dict, key: str, default):
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default


def _refuse_config(config: dict) -> None:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind not in _SUPPORTED_TYPES:
        raise UnservableAdapter(f"peft_type {kind} is not served (LoRA only)")
    if config.get("use_dora"):
        raise UnservableAdapter("DoRA (use_dora) is not served: export a plain LoRA adapter")
    if config.get("modules_to_save"):
        raise UnservableAdapter(f"modules_to_save {config['modules_to_save']} is not served: those are whole "
                                "replaced modules, not a low-rank update")  # fmt: skip
    if config.get("bias", "none") != "none":
        raise UnservableAdapter(f"bias {config['bias']!r} is not served (bias='none' only)")
    for key in ("layer_replication", "trainable_token_indices", "target_parameters"):
        if config.get(key):
            raise UnservableAdapter(f"{key} is not served")
    if config.get("fan_in_fan_out"):
        raise UnservableAdapter("fan_in_fan_out (GPT-2 Conv1D layout) is not served")


def check(config: dict, tensors: dict[str, torch.Tensor], base: dict) -> LoraAdapter:
    """The adapter, checked against the base's HF config; ``UnservableAdapter`` naming the first problem."""
    _refuse_config(config)
    shapes, layers = base_shapes(base), int(base["num_hidden_layers"])
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PEFT_NAME.match(name)
        if m is None:
            what = ("DoRA (lora_magnitude_vector)" if "lora_magnitude_vector" in name
                    else "an embedding adapter" if "lora_embedding" in name
                    else "lm_head" if "lm_head" in name else "an unknown module")  # fmt: skip
            raise UnservableAdapter(f"tensor {name}: {what} is not served (targets: the decoder layers' "
                                    f"{', '.join(PROJECTIONS)})")  # fmt: skip
        layer, parent, proj, ab = int(m[1]), m[2], m[3], m[4]
        if PROJECTIONS.get(proj) != parent:
            raise UnservableAdapter(f"tensor {name}: {parent}.{proj} is not a linear of this base")
        if layer >= layers:
            raise UnservableAdapter(f"tensor {name}: layer {layer}, the base has {layers}")
        pairs.setdefault((layer, proj), {})[ab] = t
    if not pairs:
        raise UnservableAdapter("no LoRA tensors in adapter_model.safetensors")
    targets = []
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise UnservableAdapter(f"layers.{layer}.{proj}: lora_{'A' if 'A' not in ab else 'B'} is missing")
        a, b = ab["A"].to(torch.float32).contiguous(), ab["B"].to(torch.float32).contiguous()
        n, k = shapes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape != (n, r) or r < 1:
            raise UnservableAdapter(f"layers.{layer}.{proj}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                    f"the base's [{n}, {k}] at one rank")  # fmt: skip
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise UnservableAdapter(f"layers.{layer}.{proj}: a weight is not finite")
        key = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
        r_cfg = int(_pattern_value(config.get("rank_pattern"), key, config.get("r", r)))
        if r_cfg != r:
            raise UnservableAdapter(f"layers.{layer}.{proj}: rank {r} in the tensors, {r_cfg} in adapter_config.json")
        alpha = float(_pattern_value(config.get("alpha_pattern"), key, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        targets.append(LoraTarget(layer, proj, a, b, scaling))
    return LoraAdapter(targets, config)
