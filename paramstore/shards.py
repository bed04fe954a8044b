"""Layer-aligned shards: how a checkpoint is cut, and the self-describing blob of one shard.

Cutting: tensors are grouped per transformer block; consecutive blocks fill a
shard up to the target size, and a boundary always falls between blocks unless a
single block is larger than the target (then that block is split by tensor).
The token embedding is a shard of its own ("embed"), the final norm and the LM
head another ("head"); the tokenizer and chat template travel as a "bundle" shard.

Blob: a shard is a standard safetensors file. Its ``__metadata__`` says what it
carries (``kind``, ``layers``, storage ``dtype``, quantization ``scheme``), so
a node can inject it layer by layer without the manifest. ``unpack`` parses the
header itself and returns ``torch.frombuffer`` views of the caller's buffer:
zero-copy (``safetensors.torch.load(bytes)`` would copy every tensor).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as st_save

from .buffers import ALIGN  # tensor data starts at a multiple of this in a blob
from .errors import IntegrityError
from .sources import layer_of

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@dataclass(slots=True)
class ShardPlan:
    """The tensors of one shard before packing."""

    kind: str  # embed | layers | head | bundle
    layers: list[int] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _group_kind(name: str) -> str:
    if layer_of(name) is not None:
        return "layers"
    return "embed" if "embed_tokens" in name else "head"


def cut_shards(tensors: Iterable[tuple[str, torch.Tensor]], target_bytes: int) -> Iterator[ShardPlan]:
    """Stream (name, tensor) in checkpoint order -> layer-aligned ShardPlans, in load order.

    Load order is embed, blocks 0..L-1, head, so a node can start layer by layer.
    Tensors must arrive grouped by block (HF and GGUF checkpoints are).
    """
    embed = ShardPlan("embed")
    head = ShardPlan("head")
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    current = ShardPlan("layers")
    emitted_embed = False
    last_layer = -1
    for name, t in tensors:
        kind = _group_kind(name)
        if kind == "embed":
            embed.tensors[name] = t
            continue
        if kind == "head":
            head.tensors[name] = t
            continue
        layer = layer_of(name)
        blocks.setdefault(layer, {})[name] = t
        if layer != last_layer and last_layer in blocks:
            # a block is complete once the next one starts
            if not emitted_embed and embed.tensors:
                emitted_embed = True
                yield embed
            yield from _add_block(current, last_layer, blocks.pop(last_layer), target_bytes)
        last_layer = layer
    if last_layer in blocks:
        yield from _add_block(current, last_layer, blocks.pop(last_layer), target_bytes)
    if not emitted_embed and embed.tensors:
        yield embed
    if current.tensors:
        yield current
    if head.tensors:
        yield head


def _add_block(current: ShardPlan, layer: int, block: dict[str, torch.Tensor], target: int) -> Iterator[ShardPlan]:
    """Append one block to the running shard; yield shards that became full."""
    size = sum(t.numel() * t.element_size() for t in block.values())
    if current.tensors and current.nbytes + size > target:
        yield ShardPlan("layers", list(current.layers), dict(current.tensors))
        current.layers.clear()
        current.tensors.clear()
    if size <= target:
        current.layers.append(layer)
        current.tensors.update(block)
        return
    # a block larger than the target: split it by tensor
    for name, t in sorted(block.items()):
        tsize = t.numel() * t.element_size()
        if current.tensors and current.nbytes + tsize > target:
            yield ShardPlan("layers", list(current.layers), dict(current.tensors))
            current.layers.clear()
            current.tensors.clear()
        if layer not in current.layers:
            current.layers.append(layer)
        current.tensors[name] = t


def pack(plan: ShardPlan, meta: dict[str, str] | None = None) -> bytes:
    """ShardPlan -> safetensors bytes with self-describing metadata, data 64-byte aligned."""
    md = {"kind": plan.kind, "layers": json.dumps(plan.layers), **(meta or {})}
    return align_header(st_save({k: v.contiguous() for k, v in plan.tensors.items()}, metadata=md))


def align_header(blob: bytes) -> bytes:
    """Pad a safetensors header with spaces (the format's own padding) so the data starts at a
    multiple of ``ALIGN``. Tensors whose sizes are multiples of ``ALIGN`` (every tensor of the
    usual model shapes) then sit at aligned offsets of an aligned buffer: zero-copy injection."""
    (n,) = struct.unpack_from("<Q", blob, 0)
    pad = -(8 + n) % ALIGN
    if pad == 0:
        return blob
    return struct.pack("<Q", n + pad) + blob[8 : 8 + n] + b" " * pad + blob[8 + n :]


def pack_files(files: dict[str, bytes]) -> bytes:
    """The bundle (tokenizer, chat template, ...) as a safetensors blob of uint8 tensors."""
    tensors = {f"file/{n}": torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
               for n, b in files.items()}  # fmt: skip
    return st_save(tensors, metadata={"kind": "bundle", "layers": "[]"})


def unpack(buf) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors bytes -> (tensors viewing buf, metadata). buf should be writable (bytearray)."""
    mv = memoryview(buf)
    if len(mv) < 8:
        raise IntegrityError("shard blob shorter than its header")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if 8 + n > len(mv):
        raise IntegrityError("shard blob header runs past its end")
    header = json.loads(bytes(mv[8 : 8 + n]))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = info["shape"]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(mv, dtype=dtype, count=count, offset=base + start).view(shape)
    return out, meta


def unpack_files(buf) -> dict[str, bytes]:
    tensors, _ = unpack(buf)
    return {k[len("file/"):]: t.numpy().tobytes() for k, t in tensors.items() if k.startswith("file/")}
