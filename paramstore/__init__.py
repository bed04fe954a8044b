"""paramstore: the erasure-coded INT8 parameter store of pdserve.

Public API (imported lazily, so ``import paramstore`` does not import torch)::

    store = ParamStore(StoreConfig.local_default())
    store.import_model("path/to/hf-folder-or.gguf", name="smollm2")
    cache = NodeCache(CacheConfig(dir="/var/cache/pdserve", disk_bytes=8 << 30, memory_bytes=2 << 30))
    with store.reader("smollm2", ReaderConfig(prefetch=2), cache=cache) as r:
        for shard in r.iter_shards():
            tensors, meta = shard.tensors()
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "StoreConfig": "config", "parse_ref": "config", "validate_name": "config",
    "StoreError": "errors", "InvalidRequest": "errors", "NotFound": "errors", "ConflictRetry": "errors",
    "IntegrityError": "errors", "LocationUnavailable": "errors", "NotEnoughFragments": "errors",
    "Manifest": "manifest", "ShardInfo": "manifest",
    "quantize_int8": "quant", "dequantize_int8": "quant", "quantize_int4": "quant4", "dequantize_int4": "quant4",
    "ModelReader": "reader", "ReaderConfig": "reader", "ShardRead": "reader",
    "ParamStore": "store",
    "CacheConfig": "cache", "NodeCache": "cache",
    "PopularityTracker": "popularity",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'paramstore' has no attribute {name!r}")
