"""LoRA adapters in the store: a PEFT adapter kept as its own versioned, sealed, erasure-coded object.

Lifecycle of ``paramstore import-adapter DIR --base MODEL[@vN] --name NAME``:
 1. the base's manifest is read and its version pinned (an adapter is trained on those weights);
 2. the PEFT directory is read and checked against the base's shapes (``paramstore/lora.py``): what a node cannot
    apply is refused, naming it, before anything is written;
 3. its canonical tensors (fp32; the base's erasure code unless told, ``model.layers.L.PROJ.lora_A|B``) go through a model's import pipeline
    (``writer``: layer-aligned shards, zfec, content-addressed fragments on every location), no bundle files;
 4. the manifest is published last with ``adapter`` = {base, digest, scalings, ranks, targets, peft}, sealed with
    the rest, so ``ls``/``show``/``verify``/``repair``/``rm``/``gc`` treat it as they treat a model.

Reading (a node's first request naming it): ``read_adapter`` rebuilds the ``LoraAdapter`` from its shards.
An adapter's name shares the models' namespace: a request's ``model`` names either.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import writer as _writer
from .config import parse_ref
from .errors import InvalidRequest
from .lora import LoraAdapter, check, read_peft
from .manifest import Manifest
from .sources import ModelSource

if TYPE_CHECKING:
    from .store import ImportResult, ParamStore


def import_adapter(store: ParamStore, src: str | Path, base: str, name: str, progress=None,
                   k: int | None = None, m: int | None = None) -> ImportResult:
    """``k``/``m``: the erasure code (None: the base's, which its locations already hold)."""
    from .store import ImportResult

    t0 = time.perf_counter()
    parse_ref(name)
    if "@" in name:
        raise InvalidRequest(f"import-adapter takes an adapter name, not a version: {name!r}")
    base_m = store.manifest(base)  # NotFound names it
    if base_m.adapter is not None:
        raise InvalidRequest(f"{base_m.ref} is an adapter: an adapter's base is a model")
    if name == base_m.name:
        raise InvalidRequest(f"an adapter cannot take its base's name {name!r}")
    if name in store.models() and store.manifest(name).adapter is None:
        raise InvalidRequest(f"{name!r} is a model: choose another name for the adapter")
    peft_config, tensors = read_peft(src)
    adapter = check(peft_config, tensors, base_m.config)
    canonical = adapter.tensors()
    source = ModelSource(base_m.config, sorted(canonical), canonical.__getitem__, source_format="peft")
    config = dataclasses.replace(store.config, k=k or base_m.k, m=m or base_m.m)  # validated as it is made
    config.check_writable()
    manifest, _, w = _writer.build_manifest(config, store.locations, store.pool, source, name, "fp32", progress)
    manifest.adapter = {"base": base_m.ref, "digest": adapter.digest(), "scalings": adapter.scalings(),
                        "ranks": adapter.ranks, "targets": adapter.target_modules, "peft": peft_config}  # fmt: skip
    try:
        w.check_landed(manifest.shards)
        manifest = store.catalog.publish(manifest)
    except BaseException:
        store._discard(w)
        raise
    return ImportResult(manifest, None, time.perf_counter() - t0)


def read_adapter(store: ParamStore, ref: str | Manifest, cache=None) -> LoraAdapter:
    """An adapter's tensors from the store (any k of n fragments per shard, verified as a model's are)."""
    m = ref if isinstance(ref, Manifest) else store.manifest(ref)
    if m.adapter is None:
        raise InvalidRequest(f"{m.ref} is a model, not an adapter")
    tensors = {}
    with store.reader(m, cache=cache) as r:
        for shard in r.iter_shards():
            got, _ = shard.tensors()
            tensors.update((n, t.clone()) for n, t in got.items())  # off the shard's buffer
    adapter = LoraAdapter.from_canonical(tensors, m.adapter["scalings"], m.adapter["peft"])
    return adapter
