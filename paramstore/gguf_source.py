"""A llama.cpp GGUF file opened as a ``ModelSource`` (HF Llama naming, fp32).

On-disk layout (GGUF v3, little-endian)::

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key, type, value)     hyper-parameters under "{arch}.*", tokenizer
                                  under "tokenizer.ggml.*", "tokenizer.chat_template"
    n_tensors x (name, ne[], type, offset)
    aligned tensor data           quantized blocks (Q4_1, Q8_0, ...) or F32/F16

``gguf.GGUFReader`` memory-maps the file; nothing is dequantized at open.

Metadata -> config.json (only ``general.architecture == "llama"``)::

    llama.embedding_length / feed_forward_length / block_count
        -> hidden_size / intermediate_size / num_hidden_layers
    llama.attention.head_count / head_count_kv / layer_norm_rms_epsilon
        -> num_attention_heads / num_key_value_heads / rms_norm_eps
    llama.rope.dimension_count / rope.freq_base / context_length
        -> head_dim / rope_theta / max_position_embeddings
    llama.rope.scaling.* (linear, yarn) or a rope_freqs.weight tensor (Llama 3)
        -> rope_scaling
    tokenizer.ggml.{bos,eos,padding}_token_id -> {bos,eos,pad}_token_id

Tensors (a ggml shape ``ne = [in, out]`` is numpy/HF ``[out, in]``)::

    token_embd.weight        -> model.embed_tokens.weight              [V, D]
    blk.N.attn_q/k/v.weight  -> model.layers.N.self_attn.{q,k,v}_proj  [H*hd | KV*hd, D]
    blk.N.attn_output.weight -> model.layers.N.self_attn.o_proj        [D, H*hd]
    blk.N.ffn_gate/up.weight -> model.layers.N.mlp.{gate,up}_proj      [F, D]
    blk.N.ffn_down.weight    -> model.layers.N.mlp.down_proj           [D, F]
    blk.N.attn_norm/ffn_norm -> input_layernorm / post_attention_layernorm [D]
    output_norm.weight       -> model.norm.weight                      [D]
    output.weight            -> lm_head.weight (absent: tied embeddings)

llama.cpp's converter permutes the rows of Q and K so that each head's rotary
pairs are interleaved; ``_unpermute`` undoes it. The tokenizer (``gpt2`` =
byte-level BPE) is rebuilt from the vocabulary and merges with ``tokenizers``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .errors import InvalidRequest
from .sources import ModelSource

GGUF_MAGIC = b"GGUF"
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_ORIG_CTX = 8192  # llama.cpp assumes this when it writes rope_freqs
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF suffix of a per-layer tensor -> HF suffix.
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Metadata:
    """Typed access to a GGUF's key/value metadata; missing required keys -> InvalidRequest."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields = reader.fields
        self.path = path
        self.arch = self.require("general.architecture")

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise InvalidRequest(f"GGUF {self.path.name} lacks required metadata {key}")
        return value

    def hparam(self, key: str, default=None, required: bool = False):
        """``{arch}.{key}``, e.g. hparam("block_count") -> llama.block_count."""
        return self.require(f"{self.arch}.{key}") if required else self.get(f"{self.arch}.{key}", default)


def open_gguf(path: Path) -> ModelSource:
    """Open a Llama GGUF lazily; raises InvalidRequest (one line) when it cannot be used."""
    path = Path(path)
    reader = _open_reader(path)
    meta = _Metadata(reader, path)
    if meta.arch != "llama":
        raise InvalidRequest(f"GGUF {path.name} has architecture {meta.arch!r}; only 'llama' is supported")
    by_name = {t.name: t for t in reader.tensors}
    config = _build_config(meta, by_name)
    hf_to_gguf = _tensor_map(config, by_name, path)
    _check_tensors(config, hf_to_gguf, by_name, path)
    tokenizer = _build_tokenizer(meta)
    return ModelSource(
        config=config,
        tensor_names=list(hf_to_gguf),
        load_tensor=_tensor_loader(config, hf_to_gguf, by_name),
        files=_bundle_files(meta, config, tokenizer),
        source_format="gguf",
    )


def _open_reader(path: Path) -> GGUFReader:
    """GGUFReader on a file checked to be a whole GGUF (magic, parsable header, all tensor bytes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InvalidRequest(f"cannot read GGUF {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise InvalidRequest(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}): {path}")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"truncated or corrupt GGUF {path} ({size} bytes): {e}") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise InvalidRequest(f"truncated GGUF {path}: tensor {t.name} ends at byte {end}, file has {size}")
    return reader


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _build_config(meta: _Metadata, by_name: dict[str, ReaderTensor]) -> dict:
    hidden = int(meta.hparam("embedding_length", required=True))
    heads = int(meta.hparam("attention.head_count", required=True))
    theta = _f32(meta.hparam("rope.freq_base", 10000.0))
    head_dim = int(meta.hparam("rope.dimension_count", hidden // heads))
    vocab = meta.hparam("vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.hparam("feed_forward_length", required=True)),
        "num_hidden_layers": int(meta.hparam("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.hparam("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.hparam("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, by_name.get("rope_freqs.weight"), theta, head_dim),
        "max_position_embeddings": int(meta.hparam("context_length", required=True)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _rope_scaling(meta: _Metadata, rope_freqs: ReaderTensor | None, theta: float, head_dim: int) -> dict | None:
    """HF rope_scaling from ``rope.scaling.*`` keys, or from a Llama-3 ``rope_freqs`` tensor."""
    kind = meta.hparam("rope.scaling.type")
    factor = meta.hparam("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor:
        orig = meta.hparam("rope.scaling.original_context_length", required=True)
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings": int(orig)}
    if kind not in (None, "none", "linear", "yarn"):
        raise InvalidRequest(f"GGUF {meta.path.name}: unsupported rope scaling type {kind!r}")
    if rope_freqs is None:
        return None
    factors = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), np.float64).reshape(-1)
    return _llama3_rope_scaling(factors, theta, head_dim, meta.path)


def _llama3_factors(theta: float, head_dim: int, factor: float, lo: float, hi: float) -> np.ndarray:
    """Per-frequency divisors of Llama-3 rope scaling, as convert_hf_to_gguf writes them."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim / 2]
    smooth = (_LLAMA3_ORIG_CTX / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < _LLAMA3_ORIG_CTX / hi, 1.0, np.where(wavelen > _LLAMA3_ORIG_CTX / lo, factor, mid))


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict | None:
    """Invert ``_llama3_factors``: factor = max; low/high_freq_factor from the smooth band's line."""
    if factors.shape != (head_dim // 2,):
        raise InvalidRequest(f"GGUF {path.name}: rope_freqs.weight has {factors.size} values, need {head_dim // 2}")
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    lo, hi = 1.0, 4.0  # Llama 3.1 defaults when the band has too few points to fit
    if band.sum() >= 2:
        # smooth = (ctx / wavelen - lo) / (hi - lo) is a line a * x + b in x = ctx / wavelen
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(_LLAMA3_ORIG_CTX / wavelen[band], smooth, 1)
        lo = float(f"{-b / a:.4g}")
        hi = float(f"{lo + 1 / a:.4g}")
    if not np.allclose(_llama3_factors(theta, head_dim, factor, lo, hi), factors, rtol=1e-4):
        raise InvalidRequest(f"GGUF {path.name}: rope_freqs.weight is not Llama-3 rope scaling")
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": lo,
        "high_freq_factor": hi,
        "original_max_position_embeddings": _LLAMA3_ORIG_CTX,
    }


def _tensor_map(config: dict, by_name: dict[str, ReaderTensor], path: Path) -> dict[str, str]:
    """HF name -> GGUF name, in file order; unknown or missing tensors -> InvalidRequest."""
    n_layers = config["num_hidden_layers"]
    hf_to_gguf: dict[str, str] = {}
    for name in by_name:
        if name == "rope_freqs.weight":  # folded into config["rope_scaling"]
            continue
        hf = _GLOBAL_TENSORS.get(name)
        if hf is None and name.startswith("blk."):
            layer, _, suffix = name[4:].partition(".")
            if layer.isdigit() and int(layer) < n_layers and suffix in _LAYER_TENSORS:
                hf = f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
        if hf is None:
            raise InvalidRequest(f"GGUF {path.name}: unexpected tensor {name} for a {n_layers}-layer llama")
        hf_to_gguf[hf] = name
    needed = [f"blk.{i}.{s}" for i in range(n_layers) for s in _LAYER_TENSORS]
    missing = [n for n in ["token_embd.weight", "output_norm.weight", *needed] if n not in by_name]
    if missing:
        raise InvalidRequest(f"GGUF {path.name} lacks tensor {missing[0]} ({len(missing)} missing)")
    return hf_to_gguf


def _hf_shape(config: dict, hf_name: str) -> tuple[int, ...]:
    """The HF [out, in] shape the config implies for a tensor ([D] for the norms)."""
    d, f, v, hd = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    suffix = hf_name.rsplit(".", 2)[-2]
    return {
        "embed_tokens": (v, d), "lm_head": (v, d), "q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d),
        "o_proj": (d, q), "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f),
    }.get(suffix, (d,))  # fmt: skip


def _check_tensors(config: dict, hf_to_gguf: dict[str, str], by_name: dict[str, ReaderTensor], path: Path) -> None:
    """Shapes agree with the config, and every tensor type can be dequantized (one row each)."""
    tried = set()
    for hf, name in hf_to_gguf.items():
        t = by_name[name]
        shape, want = tuple(int(n) for n in reversed(t.shape)), _hf_shape(config, hf)  # ggml ne is [in, out]
        if shape != want:
            raise InvalidRequest(f"GGUF {path.name}: tensor {name} has shape {shape}, the config needs {want}")
        if t.tensor_type not in tried:
            try:
                dequantize(t.data[:1], t.tensor_type)
            except NotImplementedError:
                kind = t.tensor_type.name
                raise InvalidRequest(f"GGUF {path.name}: tensor {name} is {kind}; gguf cannot dequantize it") from None
            tried.add(t.tensor_type)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of Q/K. w: [rows, cols] -> [rows, cols]."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensor_loader(config: dict, hf_to_gguf: dict[str, str], by_name: dict[str, ReaderTensor]):
    """name -> fp32 tensor, dequantized from the memory-mapped reader on each call."""
    n_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def load(hf_name: str) -> torch.Tensor:
        t = by_name[hf_to_gguf[hf_name]]  # KeyError for a name the source does not have
        w = dequantize(t.data, t.tensor_type).reshape(_hf_shape(config, hf_name))
        proj = hf_name.rsplit(".", 2)[-2]
        if proj in n_heads:
            w = _unpermute(w, n_heads[proj])
        # F32 data is a view of the read-only mmap: copy it out
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))

    return load


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token using chars outside the byte alphabet is re-spelled in it (as transformers does)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    return {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char table of byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in keep)
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def _pre_tokenizer(pre: str | None, path: Path):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt-2"):
        return byte_level
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise InvalidRequest(f"GGUF {path.name}: unsupported tokenizer.ggml.pre {pre!r}")


def _build_tokenizer(meta: _Metadata) -> Tokenizer:
    """Byte-level BPE from tokens + merges; control tokens special, user-defined ones added."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidRequest(f"GGUF {meta.path.name}: tokenizer {kind!r} is not supported (only gpt2 byte-level BPE)")
    tokens = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    types = meta.get("tokenizer.ggml.token_type") or []
    vocab = _byte_level_vocab(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), meta.path)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    special = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def _bundle_files(meta: _Metadata, config: dict, tokenizer: Tokenizer) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json (chat template), generation_config.json."""
    tokens = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "tokenizer.json": tokenizer.to_str().encode("utf-8"),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False).encode("utf-8"),
        "generation_config.json": json.dumps(generation, indent=2).encode("utf-8"),
    }
