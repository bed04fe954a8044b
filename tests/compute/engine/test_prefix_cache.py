"""Automatic prefix caching (compute/engine/prefix_hash.py, compute/engine/prefix_cache.py, compute/engine/block_manager.py):
hash chains, eviction order, hits that equal misses, isolation by salt, and no leaked blocks."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import torch

from compute.engine.block_manager import BlockManager
from compute.engine.engine import Engine
from compute.engine.prefix_hash import ROOT, block_hash, block_hashes, extra_keys
from compute.engine.sampling import SamplingParams
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import Sequence
from tests.compute.engine.scheduling import run_to_completion
from tests.compute.tiny import invariant_tiny_model, tiny_model

BS = 16
EXTRA = extra_keys("tiny@v1/fp32", "float32", BS)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def invariant_model():
    """What ``kernels = invariant`` gives a node (tests/compute/tiny.py)."""
    return invariant_tiny_model()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 13 * seed) % 290 + 1 for i in range(n)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 8), temperature=0, ignore_eos=True, **kw)


def _run(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], int | None]:
    """One request to completion: its tokens, its tokens' logprobs (if asked) and its cached_tokens."""
    sid, toks, lps, cached = eng.add_request(prompt, params), [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.seq_id == sid:
                toks += o.new_token_ids
                lps += [lp.logprob for lp in o.logprobs]
                cached = o.cached_tokens if o.cached_tokens is not None else cached
    eng.scheduler.check_blocks()
    return toks, lps, cached


# ---- the hash chain --------------------------------------------------------------------------------


def test_hash_chain_is_the_same_in_another_process_and_names_everything_before_it():
    toks = _prompt(70)
    here = block_hashes(toks, BS, EXTRA, "tenant-a")
    code = ("import sys; from compute.engine.prefix_hash import block_hashes, extra_keys; "
            f"print(','.join(h.hex() for h in block_hashes({toks!r}, {BS}, extra_keys('tiny@v1/fp32', 'float32', {BS}),"
            " 'tenant-a')))")  # fmt: skip
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert there.split(",") == [h.hex() for h in here]  # no per-process seed (PYTHONHASHSEED differs per process)
    assert len(here) == 4 and all(len(h) == 32 for h in here)  # full blocks only: 70 tokens, 4 blocks of 16
    # the chain: each hash is the block's own over its parent's
    assert here[0] == block_hash(ROOT, toks[:16], EXTRA, "tenant-a") and here[1] == block_hash(here[0], toks[16:32], EXTRA)
    assert block_hashes(toks, BS, EXTRA, "tenant-a", start=2, parent=here[1]) == here[2:]
    # another salt, no salt, an empty salt, other extra keys: no block in common
    for other in (block_hashes(toks, BS, EXTRA, "tenant-b"), block_hashes(toks, BS, EXTRA),
                  block_hashes(toks, BS, EXTRA, ""), block_hashes(toks, BS, extra_keys("tiny@v2/fp32", "float32", BS), "tenant-a"),
                  block_hashes(toks, BS, extra_keys("tiny@v1/fp32", "bfloat16", BS), "tenant-a")):  # fmt: skip
        assert not set(other) & set(here)
    # one token changed in block 1: block 0 still shared, every later one differs (a different parent)
    changed = toks[:20] + [toks[20] + 1] + toks[21:]
    alt = block_hashes(changed, BS, EXTRA, "tenant-a")
    assert alt[0] == here[0] and all(a != b for a, b in zip(alt[1:], here[1:]))
    # the same tokens of a later block after another parent: another hash
    assert block_hash(here[0], toks[32:48], EXTRA) != here[2]


def test_hashing_costs_little_beside_a_prefill():
    toks = _prompt(2048)
    t0 = time.perf_counter()
    for _ in range(5):
        block_hashes(toks, BS, EXTRA)
    per_prompt = (time.perf_counter() - t0) / 5
    assert per_prompt < 0.02, f"hashing a 2,048-token prompt took {per_prompt * 1e3:.1f} ms"  # ~0.2 ms measured


# ---- the block manager: eviction order, invariants, events -----------------------------------------


def _table(bm: BlockManager, n_blocks: int, tag: int) -> tuple[Sequence, list[bytes]]:
    s = Sequence(list(range(n_blocks * 4)), SamplingParams())
    bm.allocate(s, n_blocks * 4)
    hashes = [bytes([tag, i]) * 16 for i in range(n_blocks)]
    bm.publish(s.block_table, hashes)
    return s, hashes


def test_eviction_is_lru_over_free_cached_blocks_a_requests_tail_first():
    bm = BlockManager(8, 4)
    a, ha = _table(bm, 3, 1)
    b, hb = _table(bm, 3, 2)
    blocks_a, blocks_b = list(a.block_table), list(b.block_table)
    bm.free(a)  # a first: least recently used
    bm.free(b)
    assert bm.num_free == 8 and bm.num_cached == 6
    bm.check([])
    c = Sequence(list(range(32)), SamplingParams())
    bm.allocate(c, 8)  # 2 blocks: the 2 plain ones, no eviction
    assert bm.evictions == 0 and bm.match(ha) == blocks_a and bm.match(hb) == blocks_b
    bm.drain_events()
    bm.allocate(c, 20)  # 3 more: evicts a's tail, then the block before it
    assert c.block_table[2:] == [blocks_a[2], blocks_a[1], blocks_a[0]] and bm.evictions == 3
    assert bm.match(ha) == [] and bm.match(hb) == blocks_b
    assert [(e.kind, e.hashes) for e in bm.drain_events()] == [("removed", [ha[2]]), ("removed", [ha[1]]), ("removed", [ha[0]])]
    # a hit refreshes: b's first block taken and let go again is now the last to go
    d = Sequence(list(range(8)), SamplingParams())
    bm.share(bm.match(hb[:1]), d)
    assert bm.refs(blocks_b[0]) == 1 and bm.num_free == 2
    bm.free(d)
    e = Sequence(list(range(8)), SamplingParams())
    bm.allocate(e, 8)
    assert e.block_table == [blocks_b[2], blocks_b[1]] and bm.match(hb) == [blocks_b[0]]
    bm.check([c.block_table, e.block_table])
    bm.free(c)
    bm.free(e)
    bm.check([])
    assert bm.clear() == 1 and bm.num_cached == 0 and bm.drain_events()[-1].kind == "cleared"
    bm.check([])


def test_events_say_what_was_stored_and_removed(model):
    eng = Engine.for_model(model, num_blocks=8, block_size=BS, max_num_batched_tokens=256)
    _run(eng, _prompt(50), _greedy(max_tokens=2))
    stored = [h for e in eng.drain_cache_events() if e.kind == "stored" for h in e.hashes]
    assert stored == block_hashes(_prompt(50), BS, eng.scheduler.config.cache_extra)  # 3 full prompt blocks
    _run(eng, _prompt(100, seed=1), _greedy(max_tokens=8))  # 7 blocks of 8, 3 cached: the 2 last evicted
    events = eng.drain_cache_events()
    assert [(e.kind, e.hashes) for e in events if e.kind == "removed"] == [("removed", [stored[2]]), ("removed", [stored[1]])]
    assert eng.prefix_cache_stats().evictions == 2 and eng.scheduler.blocks.match(stored) != []
    assert eng.drain_cache_events() == []


# ---- the engine: hits, what they must equal, isolation ---------------------------------------------


def test_a_repeated_prompt_hits_its_blocks_and_computes_at_least_two_tokens(model):
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    for n, cached in ((50, 48), (48, 32), (49, 32), (34, 32), (33, 16), (17, 0)):
        p = _prompt(n, seed=n)
        miss, _, c0 = _run(eng, p, _greedy())
        before = eng.prompt_tokens_computed
        hit, _, c1 = _run(eng, p, _greedy())
        assert c0 == 0 and c1 == cached and hit == miss, n
        assert eng.prompt_tokens_computed - before == n - cached
    st = eng.prefix_cache_stats()
    assert st.hits == 48 + 32 + 32 + 32 + 16 and st.queries == 2 * (50 + 48 + 49 + 34 + 33 + 17)


@pytest.mark.parametrize("budget", [512, 24])  # one chunk; chunks cut by the step's token budget
def test_hit_equals_miss_bit_for_bit_in_invariant_mode(invariant_model, budget):
    """Greedy tokens and their logprobs, bit for bit, with the prefix cache (a hit ending at any block) and
    without. 97 = 4 x 24 + 1: the budget would leave the last token a chunk of its own (the decode path)."""
    params = _greedy(max_tokens=10, logprobs=2)
    for n, cut in ((70, 16), (70, 64), (97, 32), (97, 80), (33, 32)):
        base = _prompt(n, seed=3)
        off = Engine.for_model(invariant_model, num_blocks=64, block_size=BS, max_num_batched_tokens=budget,
                               prefix_cache=False)  # fmt: skip
        want = _run(off, base, params)
        on = Engine.for_model(invariant_model, num_blocks=64, block_size=BS, max_num_batched_tokens=budget)
        _run(on, base[:cut] + _prompt(n - cut, seed=9), params)  # leaves base's first `cut` tokens cached
        got = _run(on, base, params)
        assert got[2] == min(cut, (n - 2) // BS * BS) > 0
        assert got[:2] == want[:2], (n, cut)


def test_requests_sharing_a_small_budget_are_what_they_are_alone_in_invariant_mode(invariant_model):
    """Budget 16 above 4 seats, prompts of 2-40 tokens, seeded choices (forks) and requests of their own arriving
    0-2 a step: a prefill the budget left one token of waits for the next step (else that token would run the decode
    path); every request's tokens and logprobs are what it gets alone, bit for bit."""
    import random

    rng = random.Random(11)  # a workload whose budget leaves a prefill one token (at position 32)
    kw = {"num_blocks": 128, "block_size": BS, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    reqs = []
    for i in range(12):
        same = i % 4 in (1, 2)  # choices 2 and 3 of a group of 3
        prompt = reqs[-1][0] if same else _prompt(rng.randrange(2, 40), seed=i)
        reqs.append((prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True, logprobs=0,
                                            fork_group=f"g{i // 4}" if i % 4 < 3 else None)))  # fmt: skip
    eng, ids, got = Engine.for_model(invariant_model, **kw), {}, {}
    for step in range(500):
        for _ in range(rng.randrange(0, 3)):  # 0-2 requests arrive before each step
            if len(ids) < len(reqs):
                prompt, p = reqs[len(ids)]
                ids[eng.add_request(prompt, p)] = len(ids)
        if len(ids) == len(reqs) and not eng.has_unfinished():
            break
        for o in eng.step():
            t, lp = got.setdefault(ids[o.seq_id], ([], []))
            t += o.new_token_ids
            lp += [x.logprob for x in o.logprobs]
    assert eng.scheduler.num_forked > 0
    for i, (prompt, p) in enumerate(reqs):
        alone = Engine.for_model(invariant_model, **kw)
        assert got[i] == _run(alone, prompt, SamplingParams(**{**_asdict(p), "fork_group": None}))[:2], i


def test_a_salted_request_shares_only_with_its_own_salt(model):
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    p = _prompt(60)
    assert _run(eng, p, _greedy())[2] == 0
    assert _run(eng, p, _greedy(cache_salt="tenant-a"))[2] == 0  # not the unsalted blocks
    assert _run(eng, p, _greedy(cache_salt="tenant-b"))[2] == 0  # nor another tenant's
    assert _run(eng, p, _greedy(cache_salt="tenant-a"))[2] == 48
    assert _run(eng, p, _greedy())[2] == 48


def test_prompt_logprobs_take_no_cached_blocks_and_equal_a_miss(model):
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    p = _prompt(40)
    _run(eng, p, _greedy())
    sid = eng.add_request(p, _greedy(prompt_logprobs=1))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.seq_id == sid]
    assert outs[0].cached_tokens == 0 and len(outs[0].prompt_logprobs) == 40
    off = Engine.for_model(model, num_blocks=64, block_size=BS, prefix_cache=False)
    sid = off.add_request(p, _greedy(prompt_logprobs=1))
    ref = []
    while off.has_unfinished():
        ref += [o for o in off.step() if o.seq_id == sid]
    assert [lp and lp.logprob for lp in outs[0].prompt_logprobs] == [lp and lp.logprob for lp in ref[0].prompt_logprobs]


def test_a_cached_block_is_never_written_again(model):
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    p = _prompt(64)
    _run(eng, p, _greedy(max_tokens=20))
    hit = eng.scheduler.blocks.match(block_hashes(p, BS, eng.scheduler.config.cache_extra))
    assert len(hit) == 4
    k, v = eng.runner.cache.export_blocks(hit)
    for q in (p, p[:40] + [5] * 30, p + [9] * 10):  # full hit, partial, longer
        _run(eng, q, _greedy(max_tokens=20))
    k2, v2 = eng.runner.cache.export_blocks(hit)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_forks_share_a_cached_prompt_and_are_what_they_would_be_alone(model):
    n, p = 3, _prompt(41)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 + k, ignore_eos=True, fork_group="g")
              for k in range(n)]  # fmt: skip
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    _run(eng, p, _greedy())  # the prompt's first two blocks cached
    before = eng.prompt_tokens_computed
    got = eng.generate([p] * n, params)
    assert eng.prompt_tokens_computed - before == (41 - 32) + 2 * (n - 1)  # the leader's rest, each fork's last 2
    off = Engine.for_model(model, num_blocks=64, block_size=BS, prefix_cache=False)
    assert got == off.generate([p] * n, [SamplingParams(**{**_asdict(q), "fork_group": None}) for q in params])
    eng.scheduler.check_blocks()
    assert eng.scheduler.blocks.num_free == 64


def _asdict(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_a_failover_replay_on_a_cached_prompt_continues_the_same_stream(model):
    """A replayed request (prompt + output so far, the output recomputed one token a step) hits the prompt's
    cached blocks and continues with what an uncached replay gives."""
    p = _prompt(45)
    eng = Engine.for_model(model, num_blocks=64, block_size=BS)
    first = _run(eng, p, _greedy(max_tokens=12))[0]

    def replay(e: Engine) -> list[int]:
        seq = Sequence(p + first[:5], _greedy(max_tokens=7))
        seq.replay_from = len(p)
        seq.prompt_len = len(p)
        e.scheduler.add(seq)
        out = []
        while e.has_unfinished():
            out += [t for o in e.step() if o.seq_id == seq.seq_id for t in o.new_token_ids]
        e.scheduler.check_blocks()
        return out

    off = Engine.for_model(model, num_blocks=64, block_size=BS, prefix_cache=False)
    assert replay(eng) == replay(off) == first[5:]


@pytest.mark.parametrize("seed", range(4))
def test_no_block_leaks_after_aborts_failures_and_preemption(seed):
    """Shared prefixes, salts and forks under a cache small enough to preempt; invariants checked each step."""
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                                  eos_token_ids=(2,)))  # fmt: skip
    heads = [[rng.randrange(3, 99) for _ in range(rng.randrange(4, 20))] for _ in range(3)]

    def make() -> Sequence:
        prompt = rng.choice(heads) + [rng.randrange(3, 99) for _ in range(rng.randrange(1, 16))]
        salt = rng.choice([None, None, "t"])
        group = rng.choice([None, None, "g%d" % rng.randrange(3)])
        return Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0, cache_salt=salt,
                                               fork_group=group))  # fmt: skip

    for wave in range(2):
        for _ in range(20):
            s.add(make())
        run_to_completion(s, rng, abort_p=0.05, fail_p=0.03)  # checks the invariants every step
        s.check_blocks()
        assert s.blocks.num_free == 24 and not s.seqs
    st = s.cache.stats()
    assert st.hits > 0 and s.num_preemptions > 0 and st.cached_blocks > 0


def test_preempted_sequence_comes_back_through_its_cached_blocks(model):
    eng = Engine.for_model(model, num_blocks=10, block_size=BS, max_num_batched_tokens=512)
    a, b = _prompt(60, seed=1), _prompt(60, seed=2)
    outs = eng.generate([a, b], _greedy(max_tokens=40))  # 2 x (60 + 40) tokens > 160: one is preempted
    assert eng.scheduler.num_preemptions > 0 and eng.prefix_cache_stats().hits > 0
    off = Engine.for_model(model, num_blocks=10, block_size=BS, max_num_batched_tokens=512, prefix_cache=False)
    assert outs == off.generate([a, b], _greedy(max_tokens=40))
    eng.scheduler.check_blocks()
    assert eng.scheduler.blocks.num_free == 10


def test_no_hits_cost_no_extra_compute(model):
    """At 0% hits the cache changes nothing the model runs: same steps, same prompt tokens, same output."""
    prompts = [_prompt(40 + 7 * i, seed=i) for i in range(6)]
    runs = []
    for on in (True, False):
        eng = Engine.for_model(model, num_blocks=64, block_size=BS, max_num_batched_tokens=64, prefix_cache=on)
        steps, out = 0, {i: [] for i in range(len(prompts))}
        ids = [eng.add_request(p, _greedy()) for p in prompts]
        while eng.has_unfinished():
            steps += 1
            for o in eng.step():
                out[ids.index(o.seq_id)] += o.new_token_ids
        runs.append((steps, eng.prompt_tokens_computed, out))
    assert runs[0] == runs[1]
