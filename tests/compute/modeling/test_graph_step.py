"""GraphStep (compute/modeling/graph_step.py): the decode step as one pure-tensor function computes the engine's
numbers, bit for bit, on tiny int8 and int4 models, and writes the cache as the engine does."""

from __future__ import annotations

import pytest
import torch

from compute.modeling.batch import ForwardBatch
from compute.modeling.graph_step import GraphStep, bucket_len, decode, step_inputs
from compute.modeling.kv_cache import KVCache
from compute.modeling.model import Transformer
from tests.compute.tiny import int4_tiny, int8_tiny, tiny_model

BS = 16


def _prefilled(model: Transformer, prompts: list[list[int]], keys: int):
    """Two caches holding ``prompts``' K/V (eager prefill), their block tables, the first greedy tokens."""
    per = keys // BS
    tables = [list(range(1 + j * per, 1 + (j + 1) * per)) for j in range(len(prompts))]
    caches = [KVCache(model.config, len(prompts) * per + 1, BS, torch.bfloat16) for _ in range(2)]
    with torch.inference_mode():
        first = model(ForwardBatch.build(prompts, [0] * len(prompts), tables, BS), caches[0]).argmax(-1).tolist()
    caches[1].kv.copy_(caches[0].kv)
    return caches, tables, first


@pytest.mark.parametrize("build", [int8_tiny, int4_tiny], ids=["int8", "int4"])
@pytest.mark.parametrize("lens", [[5], [5, 17, 30]], ids=["1-stream", "3-streams"])
def test_graph_step_equals_the_eager_forward_bitwise(build, lens):
    model = build()
    assert model.int4_modules() if build is int4_tiny else model.kernel_modules()
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
    keys = bucket_len(max(lens) + 8 + 1)
    caches, tables, tok = _prefilled(model, prompts, keys)
    step = GraphStep(model, len(lens))
    assert set(step.kinds.values()) == ({"int4", "float"} if build is int4_tiny else {"int8mm"})
    graph_tok, pos = list(tok), list(lens)
    with torch.inference_mode():
        for _ in range(8):  # 8 greedy steps each way: logits and the caches stay identical
            eager = model(ForwardBatch.build([[t] for t in tok], pos, tables, BS), caches[0])
            graph = decode(step, step, step_inputs(graph_tok, pos, tables, BS, keys), caches[1].kv)
            assert graph.shape == eager.shape == (len(lens), model.config.vocab_size) and graph.dtype == torch.float32
            assert torch.equal(graph, eager)
            assert torch.equal(caches[0].kv, caches[1].kv)
            tok, graph_tok = eager.argmax(-1).tolist(), graph.argmax(-1).tolist()
            pos = [p + 1 for p in pos]


def test_step_inputs_slots_and_padding():
    ids, pos, slots, ctx_slots, ctx_lens = step_inputs([9, 8], [3, 20], [[4, 5], [6, 7]], BS, 64)
    assert ids.tolist() == [9, 8] and pos.tolist() == [3, 20] and ctx_lens.tolist() == [4, 21]
    assert slots.tolist() == [4 * BS + 3, 7 * BS + 4]  # position 20 is offset 4 of the second block
    assert ctx_slots.shape == (2, 64)  # padding reads block 0 (as the engine's decode group): masked keys
    assert ctx_slots[1, :32].tolist() == list(range(6 * BS, 8 * BS)) and ctx_slots[:, 32:].lt(BS).all()
    assert step_inputs([1], [70], [[1, 2, 3, 4, 5]], BS)[3].shape == (1, 128)  # the bucket: 71 keys -> 128


def test_graph_step_refuses_a_bf16_runtime():
    model = tiny_model(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 activations"):
        GraphStep(model, 1)
