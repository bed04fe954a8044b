"""paramstore: the erasure-coded INT8 parameter store of pdserve.

Public API::

    store = ParamStore(StoreConfig.local_default())
    store.import_model("path/to/hf-folder-or.gguf", name="smollm2")
    with store.reader("smollm2", ReaderConfig(prefetch=2), cache=NodeCache(...)) as r:
        for shard in r.iter_shards():
            tensors, meta = shard.tensors()
"""

from .config import StoreConfig, parse_ref, validate_name
from .errors import (
    ConflictRetry,
    IntegrityError,
    InvalidRequest,
    LocationUnavailable,
    NotEnoughFragments,
    NotFound,
    StoreError,
)
from .manifest import Manifest, ShardInfo
from .quant import dequantize_int8, quantize_int8
from .reader import ModelReader, ReaderConfig, ShardRead
from .store import ParamStore

__all__ = [
    "ConflictRetry", "IntegrityError", "InvalidRequest", "LocationUnavailable", "Manifest", "ModelReader",
    "NotEnoughFragments", "NotFound", "ParamStore", "ReaderConfig", "ShardInfo", "ShardRead", "StoreConfig",
    "StoreError", "dequantize_int8", "parse_ref", "quantize_int8", "validate_name",
]  # fmt: skip
