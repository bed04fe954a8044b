"""compute: the Llama-family engine (paged KV cache, continuous batching, INT8) and the compute node.

Imported lazily so the CLI starts without torch::

    from compute import Engine, SamplingParams, WeightInjector
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "config", "UnsupportedModel": "errors", "WeightMismatch": "errors",
    "RequestTooLarge": "errors", "Transformer": "model", "KVCache": "kv_cache", "ForwardBatch": "batch",
    "SamplingParams": "sampling", "Scheduler": "scheduler", "SchedulerConfig": "scheduler",
    "Engine": "engine", "WeightInjector": "loader", "TextBundle": "tokenizer",
    "TextStream": "stream", "StreamEvent": "stream",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"compute.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'compute' has no attribute {name!r}")
