"""LoRA adapters in the store: a PEFT adapter kept as its own versioned, sealed, erasure-coded object.

Lifecycle of ``paramstore import-adapter DIR --base MODEL[@vN] --name NAME`` (``ParamStore.import_adapter``):
 1. the base's manifest is read and its version pinned (an adapter is trained on those weights);
 2. the PEFT directory is read and checked against the base's shapes (``paramstore/lora.py``): what a node cannot
    apply is refused, naming it, before anything is written (``check_names``, ``build``);
 3. its canonical tensors (fp32; the base's erasure code unless told, ``model.layers.L.PROJ.lora_A|B``) go through a
    model's import pipeline (``writer``: layer-aligned shards, zfec, content-addressed fragments on every location),
    no bundle files;
 4. the store publishes the manifest last with ``adapter`` = {base, digest, scalings, ranks, targets, peft}, sealed
    with the rest, so ``ls``/``show``/``verify``/``repair``/``rm``/``gc`` treat it as they treat a model.

Reading (a node's first request naming it): ``read`` rebuilds the ``LoraAdapter`` from a reader of its shards.
An adapter's name shares the models' namespace: a request's ``model`` names either.
"""

from __future__ import annotations

from pathlib import Path

from . import writer as _writer
from .config import StoreConfig, parse_ref
from .errors import InvalidRequest
from .lora import LoraAdapter, check, read_peft
from .manifest import Manifest
from .sources import ModelSource


def check_names(name: str, base: Manifest, models: dict[str, list[int]], manifest_of) -> None:
    """InvalidRequest unless ``name`` may be a new version of an adapter of ``base`` (``manifest_of(name)``: its
    latest manifest, read only if the name exists)."""
    parse_ref(name)
    if "@" in name:
        raise InvalidRequest(f"import-adapter takes an adapter name, not a version: {name!r}")
    if base.adapter is not None:
        raise InvalidRequest(f"{base.ref} is an adapter: an adapter's base is a model")
    if name == base.name:
        raise InvalidRequest(f"an adapter cannot take its base's name {name!r}")
    if name in models and manifest_of(name).adapter is None:
        raise InvalidRequest(f"{name!r} is a model: choose another name for the adapter")


def build(config: StoreConfig, locations, pool, src: str | Path, base: Manifest, name: str,
          progress=None) -> tuple[Manifest, _writer.ShardWriter]:  # fmt: skip
    """Steps 2-3: the adapter checked and written; -> its (unpublished) manifest and the writer (for a discard)."""
    peft_config, tensors = read_peft(src)
    adapter = check(peft_config, tensors, base.config)
    canonical = adapter.tensors()
    source = ModelSource(base.config, sorted(canonical), canonical.__getitem__, source_format="peft")
    config.check_writable()
    manifest, _, w = _writer.build_manifest(config, locations, pool, source, name, "fp32", progress)
    manifest.adapter = {"base": base.ref, "digest": adapter.digest(), "scalings": adapter.scalings(),
                        "ranks": adapter.ranks, "targets": adapter.target_modules, "peft": peft_config}  # fmt: skip
    return manifest, w


def read(manifest: Manifest, reader) -> LoraAdapter:
    """An adapter's tensors through ``reader`` (a ``ModelReader`` of ``manifest``: any k of n fragments per shard,
    verified as a model's are)."""
    if manifest.adapter is None:
        raise InvalidRequest(f"{manifest.ref} is a model, not an adapter")
    tensors = {}
    for shard in reader.iter_shards():
        got, _ = shard.tensors()
        tensors.update((n, t.clone()) for n, t in got.items())  # off the shard's buffer
    return LoraAdapter.from_canonical(tensors, manifest.adapter["scalings"], manifest.adapter["peft"])
