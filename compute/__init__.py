"""compute: the Llama-family engine (paged KV cache, continuous batching, INT8) and the compute node.

Rooms, lowest first (a room imports only itself, the rooms before it here, and ``errors``):
  kernels/      the INT8 linear kernels, the layers that run them, and where a node's kernel plan comes from
  modeling/     the model: config, decoder and attention, its batch input, paged KV cache, tokenizer, weight injection
  engine/       requests -> tokens: scheduler, block manager, sequences, runner, sampling, grammar, stream, stops
  kv_transfer/  moving KV blocks between processes (NIXL/UCX, TCP)
  node/         the compute node: its HTTP API, roles (prefill, decode), protocol and client

Imported lazily so the CLI starts without torch::

    from compute import Engine, SamplingParams, WeightInjector
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "modeling.config", "UnsupportedModel": "errors", "WeightMismatch": "errors",
    "RequestTooLarge": "errors", "Transformer": "modeling.model", "KVCache": "modeling.kv_cache",
    "ForwardBatch": "modeling.batch", "SamplingParams": "engine.sampling", "Scheduler": "engine.scheduler",
    "SchedulerConfig": "engine.scheduler", "Engine": "engine.engine", "WeightInjector": "modeling.loader",
    "TextBundle": "modeling.tokenizer", "TextStream": "engine.stream", "StreamEvent": "engine.stream",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"compute.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'compute' has no attribute {name!r}")
