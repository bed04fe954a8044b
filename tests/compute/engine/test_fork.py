"""n > 1 on the engine (compute/engine/scheduler.py, forks; compute/engine/block_manager.py, shared blocks): the
choices of one request compute their prompt once and share its KV blocks, copy-on-write for the
partial one, and each choice is the tokens it would have been alone.

Prompt lengths cover a shared part ending inside a block (a copy) and on a block's edge (no copy).
"""

from __future__ import annotations

import pytest
import torch

from compute.engine.engine import Engine
from compute.engine.sampling import SamplingParams
from compute.engine.sequence import FinishReason, Sequence
from tests.compute.tiny import invariant_tiny_model, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _engine(model, num_blocks: int = 64, **kw) -> Engine:
    return Engine.for_model(model, num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64, **kw)


def _prompt(n: int) -> list[int]:
    return [(7 * i) % 290 + 1 for i in range(n)]


def _params(k: int, group: str | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, seed=100 + k, ignore_eos=True, fork_group=group, **kw)


@pytest.mark.parametrize("prompt_len", [10, 11, 14])  # shared 8 (a block edge), 9 and 12 tokens
def test_choices_share_one_prefill_and_are_what_they_would_be_alone(model, prompt_len):
    prompt, n = _prompt(prompt_len), 4
    forked = _engine(model)
    got = forked.generate([prompt] * n, [_params(k, "g") for k in range(n)])
    alone = _engine(model)
    want = alone.generate([prompt] * n, [_params(k, None) for k in range(n)])
    assert got == want and len({tuple(t) for t in got}) == n  # each choice its own seed's tokens
    assert forked.scheduler.num_forked == n - 1 and alone.scheduler.num_forked == 0
    # the prompt once, then each fork's last 2 prompt tokens (by prefill: its first token from its own logits)
    assert forked.prompt_tokens_computed == prompt_len + 2 * (n - 1)
    assert alone.prompt_tokens_computed == n * prompt_len
    assert forked.scheduler.blocks.num_free == 64  # every shared block went back once, when its last holder let go


def test_a_forks_table_shares_the_full_prompt_blocks_and_owns_the_rest(model):
    eng, prompt = _engine(model), _prompt(11)  # 9 shared tokens: 2 full blocks, 1 partial one copied
    ids = [eng.add_request(prompt, _params(k, "g")) for k in range(3)]
    eng.step()  # the leader's prefill; the others fork at its end
    seqs = [eng.scheduler.seqs[i] for i in ids]
    lead, forks = seqs[0], seqs[1:]
    assert eng.scheduler.copies == [(lead.block_table[2], forks[0].block_table[2]), (lead.block_table[2], forks[1].block_table[2])]
    for f in forks:
        assert f.block_table[:2] == lead.block_table[:2] and f.num_computed == 9
        assert f.block_table[2] not in lead.block_table
    assert [eng.scheduler.blocks.refs(b) for b in lead.block_table[:2]] == [3, 3]
    eng.step()  # the copies land before the forks write their own last 2 prompt tokens
    kv = eng.runner.cache.kv  # [L, 2, NB, BS, KVH, Dh]
    for f in forks:
        assert torch.equal(kv[:, :, f.block_table[2], :1], kv[:, :, lead.block_table[2], :1])  # position 8, copied


def test_a_late_choice_forks_at_once_and_one_after_the_leader_computes_its_own(model):
    eng, prompt = _engine(model), _prompt(9)
    lead = eng.add_request(prompt, _params(0, "g"))
    eng.step()
    eng.step()  # the leader decodes
    late = eng.add_request(prompt, _params(1, "g"))
    assert eng.scheduler.num_forked == 1 and eng.scheduler.seqs[late].num_computed == 7
    while eng.has_unfinished():
        eng.step()
    before = eng.prompt_tokens_computed
    eng.generate([prompt], [_params(2, "g")])  # the group's leader is gone: a request of its own
    # ... that starts from the prompt's first block, left cached (9 tokens: a hit leaves >= 2 to compute)
    assert eng.prompt_tokens_computed - before == 9 - BS and eng.scheduler.num_forked == 1
    assert lead not in eng.scheduler.seqs and eng.scheduler.blocks.num_free == 64


def test_choices_waiting_for_a_leader_that_is_aborted_compute_their_own(model):
    eng, prompt = _engine(model), _prompt(12)
    ids = [eng.add_request(prompt, _params(k, "g")) for k in range(3)]
    assert sum(len(v) for v in eng.scheduler.parked.values()) == 2
    eng.abort(ids[0])
    outs = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.seq_id] += o.new_token_ids
    assert outs[ids[0]] == [] and all(len(outs[i]) == 8 for i in ids[1:])
    assert eng.scheduler.blocks.num_free == 64


def test_a_parked_choice_aborted_leaves_nothing_behind(model):
    eng, prompt = _engine(model), _prompt(12)
    ids = [eng.add_request(prompt, _params(k, "g")) for k in range(3)]
    eng.abort(ids[1])
    while eng.has_unfinished():
        eng.step()
    assert ids[1] not in eng.scheduler.seqs and not any(eng.scheduler.parked.values()) and eng.scheduler.blocks.num_free == 64
    assert eng.scheduler.num_forked == 1


def test_prompt_logprobs_and_other_prompts_never_fork(model):
    eng = _engine(model)
    eng.generate([_prompt(9), _prompt(9), _prompt(10)],
                 [_params(0, "g"), _params(1, "g", prompt_logprobs=1), _params(2, "g")])  # fmt: skip
    assert eng.scheduler.num_forked == 0 and eng.prompt_tokens_computed == 28


def test_forks_under_cache_pressure_finish_without_leaking_a_block(model):
    """Few blocks: forks and their leader are preempted and recomputed; every choice still gets all its tokens."""
    eng = _engine(model, num_blocks=12, max_num_seqs=8)
    prompt = _prompt(13)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=k, ignore_eos=True, fork_group="g") for k in range(4)]
    got = eng.generate([prompt] * 4, params)
    assert [len(t) for t in got] == [20] * 4 and eng.scheduler.num_preemptions > 0
    assert eng.scheduler.blocks.num_free == 12 and all(eng.scheduler.blocks.refs(b) == 0 for b in range(12))


def test_a_prefill_nodes_held_blocks_serve_forks_until_released(model):
    """The prefill role: the leader finishes at its first token with its blocks held for the transfer; a
    choice arriving then forks from the held blocks; once released, a new one computes its own prompt."""
    eng, prompt = _engine(model), _prompt(10)
    lead = Sequence(prompt, SamplingParams(max_tokens=1, fork_group="g"))
    lead.hold_kv = True
    eng.scheduler.add(lead)
    eng.step()
    assert lead.finish_reason is FinishReason.LENGTH and lead.seq_id in eng.scheduler.held
    f = eng.add_request(prompt, SamplingParams(max_tokens=1, fork_group="g"))
    assert eng.scheduler.num_forked == 1 and eng.scheduler.seqs[f].block_table[:2] == eng.scheduler.held[lead.seq_id][:2]
    eng.step()
    assert eng.scheduler.release(lead.seq_id)
    eng.add_request(prompt, SamplingParams(max_tokens=1, fork_group="g"))
    assert eng.scheduler.num_forked == 1  # released: nothing left to fork from
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.blocks.num_free == 64


def test_copy_blocks_copies_every_layer_k_and_v(model):
    from compute.modeling.kv_cache import KVCache

    cache = KVCache(model.config, 6, BS)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    cache.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(cache.kv[:, :, 4], before[:, :, 1]) and torch.equal(cache.kv[:, :, 5], before[:, :, 2])
    assert torch.equal(cache.kv[:, :, :4], before[:, :, :4])


@pytest.fixture(scope="module")
def invariant_model():
    return invariant_tiny_model()


def _choices(eng: Engine, prompt: list[int], order: list[int], group: str | None, late: int | None = None) -> dict:
    """A seeded n = 3 request's choices arriving in ``order`` (``late``: that one after the others finished), run
    to completion: choice k -> (its tokens, their logprobs)."""
    ids, out = {}, {}

    def drain() -> None:
        for _ in range(200):
            if not eng.has_unfinished():
                return
            for o in eng.step():
                out[o.seq_id][0].extend(o.new_token_ids)
                out[o.seq_id][1].extend(lp.logprob for lp in o.logprobs)
        raise AssertionError("the engine did not finish in 200 steps")

    for k in [k for k in order if k != late] + ([late] if late is not None else []):
        if k == late:
            drain()
        ids[k] = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + k, ignore_eos=True,
                                                        fork_group=group, logprobs=0))  # fmt: skip
        out[ids[k]] = ([], [])
    drain()
    return {k: out[ids[k]] for k in sorted(order)}


@pytest.mark.parametrize("prompt_len", [9, 10, 11, 33])  # shared parts ending on a block's edge and inside one
def test_a_choice_is_the_same_whether_it_leads_forks_or_comes_late(invariant_model, prompt_len):
    """Under kernels = invariant a seeded choice's tokens and logprobs are its seed's request alone, bit for bit,
    whichever choice arrives first (the leader: the prompt by prefill), forks, or arrives after the leader
    finished (a request of its own, from the cached prompt), the second time from the prefix cache too. The
    gateway sends each choice as a request of its own: their order at the node is the network's. A fork that
    computed its last prompt token alone ran the decode path (other numbers: its choice changed with the order,
    tests/gateway/routes/test_openai_params.py::test_best_of_...)."""
    prompt = _prompt(prompt_len)
    alone = {k: _choices(_engine(invariant_model), prompt, [k], None)[k] for k in range(3)}
    assert len({tuple(t) for t, _ in alone.values()}) == 3
    eng = _engine(invariant_model)
    for i, (order, late) in enumerate((([0, 1, 2], None), ([2, 0, 1], None), ([1, 2, 0], None), ([0, 1, 2], 2))):
        got = _choices(eng, prompt, order, f"g{i}", late)
        assert got == alone, (order, late, {k: got[k][1] for k in got}, {k: alone[k][1] for k in alone})
    assert eng.scheduler.num_forked == 2 + 2 + 2 + 1 and eng.scheduler.blocks.num_free == 64
