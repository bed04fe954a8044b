"""A scheduler run on plain data (no model, a fake token source) to its end, its block invariants checked every
step."""

from __future__ import annotations

import random

from compute.engine.scheduler import Scheduler
from compute.engine.sequence import Sequence, Status


def check_invariants(s: Scheduler) -> None:
    owned = len({b for q in s.seqs.values() for b in q.block_table})  # distinct: prefix-cache hits share blocks
    assert s.blocks.num_free + owned == s.blocks.num_blocks
    s.check_blocks()
    for q in s.running:
        assert q.status is Status.RUNNING and len(q.block_table) * s.config.block_size >= q.num_computed
    for q in s.waiting:
        assert q.status is Status.WAITING and q.block_table == [] and q.num_computed == 0


def run_to_completion(s: Scheduler, rng: random.Random, abort_p=0.0, fail_p=0.0, eos=2) -> list[Sequence]:
    done = []
    for _ in range(10_000):
        if not s.has_unfinished():
            return done
        b = s.schedule()
        check_invariants(s)
        assert b or s.running, "no progress"
        for x in b.seqs:
            q = s.seqs[x.seq_id]
            assert (
                x.start_pos == q.num_computed
                and x.token_ids == q.token_ids[x.start_pos : x.start_pos + len(x.token_ids)]
            )
            assert len(x.block_table) * s.config.block_size >= x.start_pos + len(x.token_ids)
        if b and rng.random() < fail_p:
            done += s.fail([x.seq_id for x in b.seqs], "boom")
            continue
        tokens = {x.seq_id: (eos if rng.random() < 0.05 else rng.randrange(3, 99)) for x in b.seqs if x.sample}
        done += s.postprocess(b, tokens)
        if rng.random() < abort_p and s.seqs:
            victim = s.abort(rng.choice(list(s.seqs)))
            done.append(victim)
        check_invariants(s)
    raise AssertionError("did not finish")
