"""The decode step captured as CUDA graphs per (batch, keys) bucket on a GPU node (``[node] step = "graph"``, cuda).

Eager dispatch launches ~5,000 kernels a decode step, which bounds a small model at a few ms a step whatever the
GPU; a CUDA graph replays the step's kernels with one launch. Lifecycle, on the engine thread:

 1. the first pure-decode batch of a bucket captures ``GraphStep`` (``compute/modeling/graph_step.py``, the kernels
    fixed for that batch size) into a graph over static input buffers (two warm-up runs on a side stream, then the
    capture; milliseconds, nothing compiled; every graph shares one memory pool);
 2. each later step of that bucket copies its inputs into the static buffers and replays the graph;
 3. rows past the batch are padding (token 0 at position 0 reading slot 0: masked work, never written back); only
    the real rows' K/V are written, after the replay (``GraphStep.write``), and their logits returned (a copy).

Buckets: batch 1, 2, 4, ... up to ``max_streams``; keys 256, 512, ... up to the model's context. The graph reads the
cache tensor in place (its address never changes). ``capture=False`` runs the same padded buffers without a graph:
the host's twin of this path, which runs in the CPU tests; the capture itself needs a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compute.modeling.graph_step import GraphStep, step_inputs
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer

KEYS_MIN = 256  # the smallest keys bucket; each next one doubles


def bucket(n: int, lo: int = 1) -> int:
    """The smallest power-of-two multiple of ``lo`` that holds ``n``."""
    b = lo
    while b < n:
        b *= 2
    return b


class CudaGraphs:
    """The captured decode steps of one engine (its thread only): ``decode`` a batch through one, else None."""

    def __init__(self, model: Transformer, cache: KVCache, max_streams: int, capture: bool = True) -> None:
        self.model, self.cache, self.max_streams, self.capture = model, cache, max_streams, capture
        bs = cache.block_size
        self.max_keys = -(-model.config.max_position_embeddings // bs) * bs
        self.graphs: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], Callable]] = {}  # (B, L) -> (static, run)
        self._steps: dict[int, GraphStep] = {}  # batch bucket -> its step (kernels fixed for that size)
        self._pool = None  # one memory pool for every graph
        self.steps = 0  # decode steps run through a graph

    def clear(self) -> int:
        n, self.graphs, self._steps, self._pool = len(self.graphs), {}, {}, None
        return n

    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]],
               cache: KVCache) -> torch.Tensor | None:  # fmt: skip
        """One decode token per sequence -> logits [B, V] and the cache written; None: no bucket holds the batch."""
        b, bs = len(tokens), cache.block_size
        keys = bucket(max(positions) + 1, max(KEYS_MIN, bs))
        if b > self.max_streams or keys > max(self.max_keys, KEYS_MIN) or cache is not self.cache:
            return None
        bb = min(bucket(b), self.max_streams)
        static, run = self.graphs.get((bb, keys)) or self._capture(bb, keys)
        pad = bb - b
        host = step_inputs(tokens + [0] * pad, positions + [0] * pad, tables + [[0]] * pad, bs, keys)
        for dst, src in zip(static, (host[0], host[1], host[3], host[4])):  # ids, positions, ctx slots, ctx lens
            dst.copy_(src, non_blocking=True)
        logits, fresh = run()
        self._steps[bb].write(cache.kv, host[2][:b].to(cache.kv.device), fresh[:, :, :b])
        self.steps += 1
        return logits[:b].clone()

    def _capture(self, bb: int, keys: int) -> tuple[tuple[torch.Tensor, ...], Callable]:
        step = self._steps.get(bb) or self._steps.setdefault(bb, GraphStep(self.model, bb))
        dev, kv = self.cache.kv.device, self.cache.kv
        long = {"dtype": torch.long, "device": dev}
        static = (torch.zeros(bb, **long), torch.zeros(bb, **long), torch.zeros(bb, keys, **long),
                  torch.ones(bb, **long))  # fmt: skip
        if not self.capture:  # the host's twin: the same padded buffers, run directly
            run = lambda: step(*static, kv)  # noqa: E731
        else:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):  # warm-up: library handles and allocations before the capture
                    step(*static, kv)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
                out = step(*static, kv)
            self._pool = graph.pool()

            def run():
                graph.replay()
                return out

        self.graphs[(bb, keys)] = (static, run)
        return static, run
