"""Block manager and scheduler on plain data: no model, a fake token source."""

from __future__ import annotations

import random

import pytest

from compute.engine.block_manager import BlockManager
from compute.engine.sampling import SamplingParams
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import FinishReason, Sequence, Status
from compute.errors import RequestTooLarge
from tests.compute.engine.scheduling import run_to_completion


def seq(n_prompt: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def test_block_manager_allocate_append_free():
    bm = BlockManager(4, 4)
    a, b = seq(5), seq(3)
    assert bm.can_allocate(a, 5) and bm.blocks_for(5) == 2
    bm.allocate(a, 5)
    bm.allocate(a, 5)  # idempotent
    assert len(a.block_table) == 2 and bm.num_free == 2
    bm.allocate(b, 3)
    assert bm.can_append(b)  # 3 tokens, room for a 4th in its block
    b.append(9)
    b.append(9)  # 5 tokens: needs a second block
    assert bm.can_append(b)
    bm.append(b)
    assert bm.num_free == 0 and not bm.can_allocate(a, 9)
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 4 and a.block_table == b.block_table == []


def test_request_that_can_never_fit_is_refused():
    s = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=100))
    with pytest.raises(RequestTooLarge, match="exceeds the limit of 16"):
        s.add(seq(10, max_tokens=7))
    s.add(seq(10, max_tokens=6))  # exactly the whole cache: fine
    s2 = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_model_len=32))
    with pytest.raises(RequestTooLarge, match="model context 32"):
        s2.add(seq(30, max_tokens=3))
    assert issubclass(RequestTooLarge, ValueError)


def test_chunked_prefill_keeps_decodes_running():
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    short, long = seq(3, max_tokens=20), seq(40, max_tokens=2)
    s.add(short)
    s.postprocess(s.schedule(), {short.seq_id: 50})  # short prefilled, now decoding
    s.add(long)
    steps = 0
    while long.num_computed < 40:
        b = s.schedule()
        ids = [x.seq_id for x in b.seqs]
        assert ids[0] == short.seq_id and len(b.seqs[0].token_ids) == 1  # the decode goes first, every step
        assert b.num_tokens <= 8
        s.postprocess(b, {x.seq_id: 60 for x in b.seqs if x.sample})
        steps += 1
    assert steps == 6  # 40 tokens in chunks of 7 (budget 8 minus the decode)
    assert len(long.output_token_ids) == 1


@pytest.mark.parametrize("seed", range(6))
def test_every_block_is_free_after_finish_abort_fail_and_preemption(seed):
    rng = random.Random(seed)
    s = Scheduler(
        SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, eos_token_ids=(2,))
    )
    seqs = [seq(rng.randrange(1, 40), max_tokens=rng.randrange(1, 30)) for _ in range(40)]
    for q in seqs[:20]:
        s.add(q)
    done = run_to_completion(s, rng, abort_p=0.05, fail_p=0.03)
    for q in seqs[20:]:  # a second wave into the same scheduler
        s.add(q)
    done += run_to_completion(s, rng, abort_p=0.05, fail_p=0.03)
    assert s.blocks.num_free == 24 and not s.running and not s.waiting and not s.seqs
    assert all(q.is_finished and q.block_table == [] for q in seqs)
    reasons = {q.finish_reason for q in seqs}
    assert FinishReason.LENGTH in reasons and FinishReason.ABORT in reasons
    assert sum(q.num_preemptions for q in seqs) > 0  # the cache was really full


def test_stop_reasons():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, eos_token_ids=(2,)))
    a, b, c = seq(3, max_tokens=5), seq(3, max_tokens=5, stop_token_ids=(77,)), seq(3, max_tokens=2, ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    s.postprocess(s.schedule(), {a.seq_id: 2, b.seq_id: 77, c.seq_id: 2})
    assert a.finish_reason is b.finish_reason is FinishReason.STOP and not c.is_finished
    s.postprocess(s.schedule(), {c.seq_id: 2})
    assert c.finish_reason is FinishReason.LENGTH and c.output_token_ids == [2, 2]
    assert s.blocks.num_free == 16


@pytest.mark.parametrize("seed", range(4))
def test_a_prefill_never_runs_a_one_token_piece_when_the_budget_allows(seed):
    """A one-token chunk runs the decode path (other numbers than a prefill's: under kernels = invariant a prompt's
    logits would depend on what else took the step's budget). With a budget above the seats, a prefill left one
    token of the budget waits for the next step: every one-token chunk is a decode (forks compute their last 2
    prompt tokens), and every request still finishes. At a budget within the seats, progress first."""
    rng = random.Random(seed)
    for budget, seats, strict in ((16, 4, True), (4, 4, False)):
        s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=seats, max_num_batched_tokens=budget))
        seqs = []
        for i in range(24):  # groups of 3 choices (forks) and requests of their own
            group = f"g{i // 3}" if i % 6 < 3 else None
            same = group is not None and i % 3 and seqs
            seqs.append(Sequence(list(seqs[-1].token_ids) if same else list(range(3, 3 + rng.randrange(2, 30))),
                                 SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True, fork_group=group)))
            s.add(seqs[-1])
        pieces = 0
        for _ in range(2_000):
            if not s.has_unfinished():
                break
            b = s.schedule()
            assert b, "no progress"
            pieces += sum(len(x.token_ids) == 1 and not x.sample for x in b.seqs)
            assert not (strict and pieces), (budget, b.seqs)
            s.postprocess(b, {x.seq_id: rng.randrange(3, 99) for x in b.seqs if x.sample})
            s.check_blocks()  # (check_invariants: a fork waits with its shared table)
        assert not s.has_unfinished() and s.blocks.num_free == 64 and all(q.is_finished for q in seqs)
        assert strict or s.num_forked > 0


def test_a_prompt_left_one_token_of_the_budget_waits_for_the_next_step():
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16))
    a, b = seq(15), Sequence(list(range(50, 60)), SamplingParams(max_tokens=8, temperature=0))  # no shared prefix
    s.add(a)
    s.add(b)
    first = s.schedule()  # a takes 15 of the 16: b's prompt waits, whole, rather than run a token by the decode path
    assert [(x.seq_id, len(x.token_ids)) for x in first.seqs] == [(a.seq_id, 15)] and b.status is Status.WAITING
    s.postprocess(first, {a.seq_id: 50})
    assert [(x.seq_id, len(x.token_ids)) for x in s.schedule().seqs] == [(a.seq_id, 1), (b.seq_id, 10)]
