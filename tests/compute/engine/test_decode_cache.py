"""A decode node's own prefix cache: imported prompts start from the blocks the node
already holds, only what it lacks is pulled, the prefill node's prefill-computed blocks are named once landed,
the decode path's never; no block leaks after activations, finishes and aborts while importing."""

from __future__ import annotations

from compute.engine.prefix_hash import extra_keys
from compute.engine.sampling import SamplingParams
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import Sequence

BS = 4


def _scheduler(prefix_cache: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=16, block_size=BS, prefix_cache=prefix_cache,
                                     cache_extra=extra_keys("tiny@v1/fp32", "float32", BS)))  # fmt: skip


def _imported(sch: Scheduler, prompt: list[int], cacheable: int, salt: str | None = None):
    seq = Sequence(prompt + [99], SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))
    seq.prompt_len = len(prompt)  # the first token came from the prefill node: output
    table, first = sch.add_imported(seq, len(prompt), cacheable)
    return seq, table, first


def test_a_later_turn_starts_from_the_blocks_an_earlier_turn_imported():
    sch = _scheduler()
    turn1 = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    a, table_a, first = _imported(sch, turn1, cacheable=2)
    assert first == 0 and len(table_a) == 3 and sch.blocks.num_cached == 0  # nothing named before it landed
    sch.activate(a.seq_id)
    assert sch.blocks.num_cached == 2  # the prefill node's full prompt blocks, named here
    sch.abort(a.seq_id)
    sch.check_blocks()
    turn2 = turn1 + [50, 51, 52, 53, 54, 55, 56]  # turn 1's prompt, its answer, a new question: 17 tokens
    b, table_b, first = _imported(sch, turn2, cacheable=3)
    assert first == 2 and table_b[:2] == table_a[:2] and len(table_b) == 5  # only blocks [2, 5) are pulled
    sch.check_blocks()
    sch.activate(b.seq_id)
    assert sch.blocks.num_cached == 3  # block 2 (the prefill's) named; block 3 was not cacheable
    sch.abort(b.seq_id)
    sch.check_blocks()
    assert sch.cache.stats().hits == 2 * BS and sch.cache.stats().queries == len(turn1) + len(turn2)


def test_the_decode_path_and_other_salts_are_never_named_or_hit():
    sch = _scheduler()
    prompt = list(range(1, 17))  # 4 full blocks
    a, _, _ = _imported(sch, prompt, cacheable=1)  # the prefill node's cache_stop ended after block 0
    sch.activate(a.seq_id)
    assert sch.blocks.num_cached == 1
    sch.abort(a.seq_id)
    b, _, first = _imported(sch, prompt, cacheable=4, salt="tenant-b")
    assert first == 0  # another tenant: no hit
    sch.abort(b.seq_id)  # aborted while importing: nothing named, nothing leaked
    assert sch.blocks.num_cached == 1
    sch.check_blocks()
    c, _, first = _imported(sch, prompt, cacheable=4)
    assert first == 1
    sch.activate(c.seq_id)
    assert sch.blocks.num_cached == 4  # the whole prompt: a full hit next time, nothing to pull
    sch.abort(c.seq_id)
    d, table, first = _imported(sch, prompt, cacheable=4)
    assert first == 4 == len(table)
    sch.abort(d.seq_id)
    sch.check_blocks()
    assert sch.blocks.num_free == sch.blocks.num_blocks


def test_no_cache_no_hit():
    sch = _scheduler(prefix_cache=False)
    prompt = list(range(1, 17))
    for _ in range(2):
        a, _, first = _imported(sch, prompt, cacheable=4)
        assert first == 0
        sch.activate(a.seq_id)
        sch.abort(a.seq_id)
    assert sch.blocks.num_cached == 0
    sch.check_blocks()
