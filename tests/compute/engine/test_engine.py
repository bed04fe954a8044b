"""The engine on a tiny random model: batch invariance, preemption, seeds, failures."""

from __future__ import annotations

import random

import pytest
import torch

from compute.engine.engine import Engine
from compute.engine.sampling import Sampler, SamplingParams
from compute.modeling.batch import ForwardBatch
from compute.modeling.kv_cache import KVCache
from tests.compute.tiny import tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(3, 300), k=rng.randrange(2, 60)) for _ in range(n)]


def test_batch_invariance_of_greedy_output(model):
    ps = prompts(16)
    alone = [Engine.for_model(model, num_blocks=64, block_size=8).generate([p], GREEDY)[0] for p in ps]
    assert len({tuple(a) for a in alone}) == 16 and all(len(a) == 24 for a in alone)
    batched = Engine.for_model(model, num_blocks=256, block_size=8, max_num_batched_tokens=64)
    assert batched.generate(ps, GREEDY) == alone
    # a cache far too small for 16 at once: chunking, queueing and preemption, same tokens
    tight = Engine.for_model(model, num_blocks=24, block_size=8, max_num_batched_tokens=32)
    assert tight.generate(ps, GREEDY) == alone
    assert tight.scheduler.blocks.num_free == 24 and tight.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(model):
    p = prompts(1, seed=1)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = Engine.for_model(model, num_blocks=32, block_size=8).generate([p], sp)[0]
    others = [SamplingParams(max_tokens=16, temperature=1.0) for _ in range(5)]
    batch = Engine.for_model(model, num_blocks=128, block_size=8).generate([p] + prompts(5), [sp] + others)[0]
    assert alone == batch
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99)
    assert Engine.for_model(model, num_blocks=32, block_size=8).generate([p], other_seed)[0] != alone


def test_sampler_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    top_k = Sampler.filtered_probs(logits[0], SamplingParams(top_k=2))
    assert (top_k[:3] == 0).all() and top_k[3:].sum() == pytest.approx(1.0)
    top_p = Sampler.filtered_probs(logits[0], SamplingParams(top_p=0.5))
    assert (top_p > 0).tolist() == [False, False, False, False, True]  # p(4) = 0.64 >= 0.5
    sampler = Sampler(seed=0)
    draws = {sampler(logits, [SamplingParams(temperature=1.0, top_k=2)], [7])[0] for _ in range(50)}
    assert draws == {3, 4}
    assert Sampler()(logits, [SamplingParams(temperature=0)], [7]) == [4]
    # seeded: a pure function of (seed, position), whatever sampler draws it
    seeded = SamplingParams(temperature=1.0, seed=5)
    by_pos = [Sampler(seed=1)(logits, [seeded], [pos])[0] for pos in range(40)]
    assert by_pos == [Sampler(seed=2)(logits, [seeded], [pos])[0] for pos in range(40)]
    assert len(set(by_pos)) > 1
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_failed_step_fails_its_requests_and_frees_blocks(model):
    eng = Engine.for_model(model, num_blocks=32, block_size=8)
    real_forward, calls = eng.runner.model.forward, {"n": 0}

    def flaky(batch, cache):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real_forward(batch, cache)

    eng.runner.model.forward = flaky
    a = eng.add_request(prompts(1)[0], GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert any(o.seq_id == a and o.finish_reason == "error" and "injected" in o.error for o in outs)
    assert eng.scheduler.blocks.num_free == 32
    eng.runner.model.forward = real_forward
    # the engine lives on: a new request runs to its end with the tokens a fresh engine gives, and one
    # aborted after its first step gets nothing more
    short = SamplingParams(max_tokens=3, temperature=0)
    b = eng.add_request([5, 6, 7], short)
    c = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0))
    first = eng.step()
    eng.abort(c)
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    tokens_b = [t for o in first + rest if o.seq_id == b for t in o.new_token_ids]
    assert tokens_b == Engine.for_model(model, num_blocks=32, block_size=8).generate([[5, 6, 7]], short)[0]
    assert [o.finish_reason for o in first + rest if o.seq_id == b and o.finished] == ["length"]
    assert [len(o.new_token_ids) for o in first if o.seq_id == c] == [1] and all(o.seq_id != c for o in rest)
    assert eng.scheduler.blocks.num_free == 32


def test_kv_blocks_exported_and_imported_continue_decoding(model):
    """The prefill/decode seam: prefill in one cache, move its blocks, decode from another."""
    p = prompts(1, seed=3)[0]
    src, dst = KVCache(model.config, 16, 8), KVCache(model.config, 16, 8)
    n = -(-(len(p) + 1) // 8)
    src_table, dst_table = [15 - 2 * i for i in range(n)], [2 * i + 1 for i in range(n)]
    tok = int(model(ForwardBatch.build([p], [0], [src_table], 8), src)[0].argmax())
    k, v = src.export_blocks(src_table)
    assert k.shape == (model.config.num_layers, n, 8, model.config.num_kv_heads, model.config.head_dim)
    dst.import_blocks(dst_table, k, v)
    step = ForwardBatch.build([[tok]], [len(p)], [src_table], 8)
    moved = ForwardBatch.build([[tok]], [len(p)], [dst_table], 8)
    assert torch.equal(model(step, src), model(moved, dst))


def test_int8mm_runtime_is_bitwise_batch_and_chunk_invariant():
    """On int8 weights with one row-invariant kernel at every M (``kernels = "invariant"``: int8mm here) and
    the bf16 KV cache, a sequence's logits are bitwise the same alone, padded beside a longer one in a
    decode batch, and whatever its prefill chunking (attention keys padded to a multiple of 16, masked)."""
    from compute.modeling.batch import ForwardBatch
    from compute.modeling.kv_cache import KVCache
    from compute.modeling.model import Transformer
    from tests.compute.tiny import int8_state

    host = tiny_model(seed=7)
    m = Transformer.build(host.config, torch.float32)
    m.load_weights(int8_state({n: b for n, b in host.named_buffers() if b is not None}))
    for lin in m.kernel_modules():
        lin.use_kernels(("int8mm",) * 4)
    a, b = [5, 9, 17, 33, 2, 71, 8, 8, 4, 19, 23], [3] * 37  # contexts 11 and 37: a is padded beside b

    def run(chunks: list[list[list[int]]]) -> list[torch.Tensor]:
        """Steps of (per sequence) token chunks; -> each step's logits (every row)."""
        cache = KVCache(m.config, 16, 8, torch.bfloat16)
        tables, pos, out = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], [0, 0], []
        for step in chunks:
            seqs = [i for i, c in enumerate(step) if c]
            fb = ForwardBatch.build([step[i] for i in seqs], [pos[i] for i in seqs], [tables[i] for i in seqs], 8,
                                    all_logits=True)  # fmt: skip
            out.append(m(fb, cache))
            for i in seqs:
                pos[i] += len(step[i])
        return out

    alone = run([[a[:-1], []], [a[-1:], []]])
    together = run([[a[:-1], b[:-1]], [a[-1:], b[-1:]]])
    assert torch.equal(together[0][: len(a) - 1], alone[0]) and torch.equal(together[1][:1], alone[1])
    chunked = run([[a[:4], []], [a[4:-1], []], [a[-1:], []]])
    assert torch.equal(torch.cat(chunked[:2]), alone[0]) and torch.equal(chunked[2], alone[1])
