"""Checkpoint sources that ``paramstore import`` reads: an HF folder or a GGUF file.

A source is opened into a ``ModelSource``: the HF ``config.json`` as a dict, the
tensors by HF name (lazily: safetensors are memory-mapped, GGUF dequantized on
demand), and the bundle files a node needs beside weights (tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InvalidRequest

# Architectures whose tensors follow the Llama layout (model.layers.N.*).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
BUNDLE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """Transformer block index of an HF tensor name, or None for embeddings/norm/head."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class ModelSource:
    """An opened checkpoint: config, lazily loaded tensors, bundle files."""

    config: dict  # HF config.json contents
    tensor_names: list[str]  # in checkpoint order
    load_tensor: Callable[[str], torch.Tensor]  # name -> tensor (HF [out, in] order)
    files: dict[str, bytes] = field(default_factory=dict)  # bundle files by name
    source_format: str = "hf"  # "hf" | "gguf"

    def __post_init__(self) -> None:
        archs = self.config.get("architectures") or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise InvalidRequest(
                f"unsupported architecture {archs[0] if archs else '(none)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.tensor_names:
            raise InvalidRequest("checkpoint holds no tensors")

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensor_names:
            yield name, self.load_tensor(name)

    def set_chat_template(self, path: str | os.PathLike) -> None:
        """Import with the jinja chat template at ``path`` instead of the checkpoint's (kept as
        chat_template.jinja, which readers prefer); InvalidRequest if unreadable or not a template."""
        import jinja2

        try:
            text = Path(path).read_text(encoding="utf-8")
            jinja2.Environment().parse(text)
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"chat template {path}: cannot be read: {e}") from None
        except jinja2.TemplateSyntaxError as e:
            raise InvalidRequest(f"chat template {path}: not a jinja template: line {e.lineno}: {e.message}") from None
        self.files["chat_template.jinja"] = text.encode("utf-8")


def open_source(path: str | os.PathLike) -> ModelSource:
    """Open an HF checkpoint folder or a GGUF file; raises InvalidRequest with one clear line."""
    p = Path(path)
    if not p.exists():
        raise InvalidRequest(f"source not found: {p}")
    if not os.access(p, os.R_OK):
        raise InvalidRequest(f"source not readable: {p}")
    if p.is_file() and p.suffix.lower() == ".gguf":
        from .gguf_source import open_gguf

        return open_gguf(p)
    if p.is_dir():
        return open_hf_folder(p)
    raise InvalidRequest(f"source must be an HF checkpoint folder or a .gguf file: {p}")


def _read_safetensors_header(f) -> tuple[int, dict]:
    head = f.read(8)
    if len(head) != 8:
        raise InvalidRequest(f"truncated safetensors file: {f.name}")
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 2**20:
        raise InvalidRequest(f"corrupt safetensors header length in {f.name}")
    raw = f.read(n)
    if len(raw) != n:
        raise InvalidRequest(f"truncated safetensors header: {f.name}")
    try:
        return n, json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"corrupt safetensors header in {f.name}: {e}") from None


def open_hf_folder(folder: Path) -> ModelSource:
    """An HF folder: config.json, *.safetensors (sharded or not), optional tokenizer files."""
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise InvalidRequest(f"no config.json in {folder}")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"unreadable config.json in {folder}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no *.safetensors files in {folder}")
    where: dict[str, Path] = {}
    for fp in files:
        size = fp.stat().st_size
        with open(fp, "rb") as f:
            n, header = _read_safetensors_header(f)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise InvalidRequest(f"truncated safetensors file: {fp} ({size} bytes, header needs {8 + n + end})")
        for name in header:
            if name != "__metadata__":
                where[name] = fp
    handles: dict[Path, object] = {}

    def load(name: str) -> torch.Tensor:
        fp = where[name]
        if fp not in handles:
            handles[fp] = safe_open(str(fp), framework="pt")
        return handles[fp].get_tensor(name)

    bundle = {n: (folder / n).read_bytes() for n in BUNDLE_FILES if (folder / n).is_file()}
    return ModelSource(config=config, tensor_names=list(where), load_tensor=load, files=bundle, source_format="hf")
