"""The decode step captured as CUDA graphs per (batch, keys) bucket (compute/engine/cuda_graphs.py): padded rows
computed and dropped, only the real rows' K/V written, the eager step's logits, and the engine's decodes through it.
On cuda the capture runs (a lent GPU); on the host its twin (``capture=False``) runs the same padded buffers, so
the bucketing, padding and write-back are checked on every machine."""

from __future__ import annotations

import random

import pytest
import torch

from compute.engine.cuda_graphs import CudaGraphs, bucket
from compute.engine.engine import Engine
from compute.engine.sampling import SamplingParams
from compute.modeling.batch import ForwardBatch
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from tests.compute.tiny import int8_state, tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda"))]
BS = 16


def _model(device: str) -> Transformer:
    host = tiny_model(seed=5)
    model = Transformer.build(host.config, torch.float32, device=device)
    model.load_weights(int8_state({n: b for n, b in host.named_buffers() if b is not None}))
    return model


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [bucket(n, 256) for n in (1, 256, 257, 700)] == [256, 256, 512, 1024]


@pytest.mark.parametrize("device", DEVICES)
def test_padded_buckets_give_the_eager_step(device):
    model = _model(device)
    graphs_cache, eager_cache = (KVCache(model.config, 40, BS, torch.bfloat16, device) for _ in range(2))
    graphs = CudaGraphs(model, graphs_cache, max_streams=4, capture=device != "cpu")
    rng = random.Random(1)
    prompts = [rng.choices(range(3, 250), k=n) for n in (7, 20, 33)]
    tables = [list(range(1 + 8 * j, 9 + 8 * j)) for j in range(3)]  # block 0 stays unused: padding reads it only
    with torch.inference_mode():
        first = model(ForwardBatch.build(prompts, [0] * 3, tables, BS).to(device), eager_cache).argmax(-1).tolist()
        graphs_cache.kv.copy_(eager_cache.kv)
        tok, pos = first, [len(p) for p in prompts]
        for n in (3, 1, 2, 3):  # buckets 4 (one padded row), 1, 2, 4
            for _ in range(3):
                g = graphs.decode(tok[:n], pos[:n], tables[:n], graphs_cache)
                e = model(ForwardBatch.build([[t] for t in tok[:n]], pos[:n], tables[:n], BS).to(device), eager_cache)
                assert g is not None and g.shape == e.shape
                torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)
                assert g.argmax(-1).tolist() == e.argmax(-1).tolist()
                tok = e.argmax(-1).tolist() + tok[n:]
                pos = [p + 1 for p in pos[:n]] + pos[n:]
    torch.testing.assert_close(graphs_cache.kv.float(), eager_cache.kv.float(), atol=2e-2, rtol=2e-2)
    assert not graphs_cache.kv[:, :, 0].any()  # padded rows were never written back
    assert sorted(graphs.graphs) == [(1, 256), (2, 256), (4, 256)] and graphs.steps == 12
    assert graphs.decode([1] * 5, [3] * 5, [[1]] * 5, graphs_cache) is None  # above max_streams: eager


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_decodes_through_the_graphs(device):
    model = _model(device)
    rng = random.Random(2)
    prompts = [rng.choices(range(3, 250), k=rng.randrange(3, 40)) for _ in range(5)]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    engine = Engine.for_model(model, num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    engine.runner.graphs = CudaGraphs(model, engine.runner.cache, 4, capture=device != "cpu")
    out = engine.generate(prompts, greedy)
    ref = Engine.for_model(model, num_blocks=64, block_size=BS, max_num_seqs=4,
                           max_num_batched_tokens=64).generate(prompts, greedy)  # fmt: skip
    assert engine.runner.graphs.steps >= 9 and all(len(o) == 10 for o in out)
    assert sum(a == b for a, b in zip(out, ref)) >= 4, (out, ref)  # a padded batch may flip a near tie, not more
