"""Import: checkpoint -> INT8 (or INT4, bf16, fp32) -> layer-aligned shards -> erasure-coded fragments -> manifest.

Lifecycle of one import:
 1. validate everything that can be checked before writing (name, codec, locations, source headers);
 2. stream tensors in load order (embed, blocks, head), convert to the storage dtype, cut shards;
 3. per shard: pack to safetensors, digest it, pad, zfec-encode, hash every fragment with xxh3,
    write fragment i to its location (placement rotates per shard by digest) — fragments are
    content-addressed, so they are invisible until a manifest names them;
 4. check every fragment landed (size), then publish the manifest last by exclusive create
    (``Catalog.publish``). A crash before step 4 leaves only orphans, which ``gc`` removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from . import metrics, quant4
from .codec import ErasureCodec
from .config import StoreConfig, validate_name
from .errors import InvalidRequest, LocationUnavailable
from .integrity import fragment_hash, shard_digest
from .locations import Location
from .manifest import FragmentRef, Manifest, ShardInfo
from .quant import SCALE_SUFFIX, SCHEME, QuantErrorSummary, quantize_int8, should_quantize
from .shards import ShardPlan, cut_shards, pack, pack_files
from .sources import ModelSource, layer_of

DTYPES = {"int8": None, "int4": None, "bf16": torch.bfloat16, "fp32": torch.float32}  # None: quantized
DTYPE_NAMES = ", ".join(DTYPES)


def placement(digest: str, n: int, num_locations: int) -> list[int]:
    """Location index of each of the n fragments: a rotation chosen by the digest (hash order)."""
    offset = int(digest[:8], 16) % num_locations
    return [(offset + i) % num_locations for i in range(n)]


def load_order(names: list[str]) -> list[str]:
    """Embedding first, blocks in numeric order, then final norm and head."""

    def key(n: str):
        layer = layer_of(n)
        if layer is not None:
            return (1, layer, n)
        return (0, 0, n) if "embed_tokens" in n else (2, 0, n)

    return sorted(names, key=key)


class ShardWriter:
    """Encodes shards and writes their fragments to the store's locations."""

    def __init__(self, config: StoreConfig, locations: list[Location], pool: ThreadPoolExecutor):
        self.config = config
        self.locations = locations
        self.codec = ErasureCodec(config.k, config.m)
        self.pool = pool
        self.written: list[tuple[Location, str]] = []

    def write(self, index: int, kind: str, layers: list[int], tensors: list[str], blob: bytes) -> ShardInfo:
        cfg = self.config
        digest = shard_digest(cfg.digest, blob)
        frag = self.codec.fragment_size(len(blob))
        buf = bytearray(self.codec.padded_size(len(blob)))
        buf[: len(blob)] = blob
        fragments = self.codec.encode(memoryview(buf), frag)
        places = placement(digest, cfg.n, len(self.locations))
        info = ShardInfo(index, kind, digest, len(blob), frag, list(layers), list(tensors))
        futures = []
        for i, (blk, loc_idx) in enumerate(zip(fragments, places)):
            info.fragments.append(FragmentRef(i, loc_idx, fragment_hash(blk)))
            loc = self.locations[loc_idx]
            rel = info.fragment_path(cfg.k, cfg.n, i)
            futures.append(self.pool.submit(self._put, loc, rel, blk))
        for f in futures:
            f.result()
        return info

    def _put(self, loc: Location, rel: str, blk) -> None:
        try:
            loc.put(rel, blk)
        except OSError as e:
            raise LocationUnavailable(f"write to {loc.url} failed: {e}") from None
        self.written.append((loc, rel))
        metrics.BYTES_WRITTEN.labels(loc.url).inc(len(blk))

    def check_landed(self, shards: list[ShardInfo]) -> None:
        """Every fragment exists with the right size (a concurrent gc must not have taken it)."""
        for s in shards:
            for fr in s.fragments:
                rel = s.fragment_path(self.config.k, self.config.n, fr.index)
                if self.locations[fr.location].size(rel) != s.fragment_size:
                    raise LocationUnavailable(f"fragment {rel} missing on {self.locations[fr.location].url} before publish")


def convert(name: str, t: torch.Tensor, dtype: str, summary: QuantErrorSummary) -> dict[str, torch.Tensor]:
    """One source tensor -> the stored tensor(s): int8 + scale for 2-D weights (int4 + scale + zero for a decoder
    layer's linears under ``int4``: ``paramstore.quant4``), else cast."""
    if dtype == "int4" and quant4.int4_eligible(name, t, layer_of(name)):
        packed, scale, zero = quant4.quantize_int4(t)
        summary.add_dequantized(name, t, quant4.dequantize_int4(packed, scale, zero), int4=True)
        return {name: packed, name + SCALE_SUFFIX: scale, name + quant4.ZERO_SUFFIX: zero}
    if dtype in ("int8", "int4") and should_quantize(name, t):
        q, scale = quantize_int8(t)
        summary.add(name, t, q, scale)
        return {name: q, name + SCALE_SUFFIX: scale}
    if t.is_floating_point():
        target = DTYPES[dtype]
        if target is None:  # int8 / int4 import: norms and vectors keep their dtype (fp32 from GGUF)
            return {name: t.contiguous()}
        return {name: t.to(target).contiguous()}
    return {name: t.contiguous()}


def quant_info(dtype: str) -> dict:
    """The manifest's ``quant`` for a quantized import: the scheme and how its tensors are named."""
    int8 = {"scheme": SCHEME, "scale_suffix": SCALE_SUFFIX, "scale_dtype": "float32"}
    if dtype == "int8":
        return int8
    return {"scheme": quant4.SCHEME, "group_size": quant4.GROUP, "scale_suffix": SCALE_SUFFIX,
            "zero_suffix": quant4.ZERO_SUFFIX, "scale_dtype": "bfloat16", "codes": "uint8 [N, K/2], even column low nibble",
            "tensors": "decoder layers' linears (K % 32 == 0); other 2-D weights int8", "int8": int8}  # fmt: skip


def build_manifest(
    config: StoreConfig,
    locations: list[Location],
    pool: ThreadPoolExecutor,
    source: ModelSource,
    name: str,
    dtype: str = "int8",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Manifest, QuantErrorSummary, ShardWriter]:
    """Steps 2-3 of the lifecycle: write every shard; return the (unpublished) manifest."""
    validate_name(name)
    if dtype not in DTYPES:
        raise InvalidRequest(f"invalid dtype {dtype!r}: {DTYPE_NAMES}")
    writer = ShardWriter(config, locations, pool)
    summary = QuantErrorSummary()
    names = load_order(source.tensor_names)
    total = len(names)
    done = 0

    def converted():
        nonlocal done
        for n in names:
            yield from convert(n, source.load_tensor(n), dtype, summary).items()
            done += 1
            if progress:
                progress(done, total)

    quantized = DTYPES[dtype] is None
    meta = {"dtype": dtype, "scheme": quant_info(dtype)["scheme"] if quantized else "none"}
    shards: list[ShardInfo] = []
    bundle = pack_files(source.files)
    shards.append(writer.write(0, "bundle", [], [f"file/{n}" for n in source.files], bundle))
    for plan in cut_shards(converted(), config.shard_bytes):
        shards.append(_write_plan(writer, len(shards), plan, meta))
    manifest = Manifest(
        name=name,
        version=0,  # assigned at publish
        created=time.time(),
        dtype=dtype,
        quant=quant_info(dtype) if quantized else None,
        config=source.config,
        k=config.k,
        m=config.m,
        digest=config.digest,
        locations=[loc.url for loc in locations],
        shards=shards,
        source={"format": source.source_format, "quant_error": summary.as_dict() if quantized else None},
    )
    return manifest, summary, writer


def _write_plan(writer: ShardWriter, index: int, plan: ShardPlan, meta: dict[str, str]) -> ShardInfo:
    blob = pack(plan, meta)
    return writer.write(index, plan.kind, plan.layers, list(plan.tensors), blob)
