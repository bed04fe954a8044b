"""Peer pull's bookkeeping in the scheduler: an exporter pins its cached run of a prompt
(released like held KV), an importer allocates a pulled prefix after its own cached blocks, names it once landed
and computes only the rest; a failed pull or an abort while pulling frees everything. The block manager's
invariant is checked after each step (the transfer itself: tests/compute/node/test_peer.py)."""

from __future__ import annotations

from compute.engine.prefix_hash import extra_keys
from compute.engine.sampling import SamplingParams
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import Sequence, Status

BS = 4


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=16, block_size=BS, max_num_batched_tokens=64,
                                     cache_extra=extra_keys("tiny@v1/fp32", "float32", BS)))  # fmt: skip


def _seq(prompt: list[int], salt: str | None = None) -> Sequence:
    return Sequence(prompt, SamplingParams(max_tokens=2, temperature=0, cache_salt=salt))


def _cached(sch: Scheduler, prompt: list[int]) -> None:
    """Compute ``prompt`` on ``sch`` (one step, greedy token 7) and finish it: its full blocks stay cached."""
    seq = _seq(prompt)
    sch.add(seq)
    batch = sch.schedule()
    sch.postprocess(batch, {seq.seq_id: 7})
    sch.abort(seq.seq_id)
    sch.check_blocks()


def test_an_export_pins_the_cached_run_until_released():
    a = _scheduler()
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    _cached(a, prompt)
    assert a.blocks.num_cached == 4
    probe = _seq(prompt)
    a.cache.prepare(probe)
    hashes = probe.block_hashes
    key, blocks = a.pin_cached(hashes[:4])
    assert key < 0 and len(blocks) == 4 and all(a.blocks.refs(b) == 1 for b in blocks)
    a.check_blocks()  # the pin is a held list: counted
    assert a.blocks.num_free == 12  # pinned: neither free nor evictable
    _cached(a, list(range(100, 146)))  # 46 other tokens take every other block
    assert a.blocks.match(hashes[:4]) == blocks
    assert a.release(key) and all(a.blocks.refs(b) == 0 for b in blocks)
    a.check_blocks()
    assert a.pin_cached([b"\0" * 32]) == (0, [])  # nothing cached: nothing pinned


def test_a_pulled_prefix_is_named_and_only_the_rest_computed():
    b = _scheduler()
    prompt = list(range(1, 19))
    _cached(b, prompt[:8])  # this node holds the first 2 blocks itself
    seq = _seq(prompt)
    table, k = b.add_pull(seq, 4 * BS)
    assert k == 2 and len(table) == 4 and seq.status is Status.IMPORTING
    assert b.cache.queries == 8  # the pull's lookup is counted when it lands
    b.check_blocks()
    assert b.admit_pulled(seq.seq_id) and seq.status is Status.WAITING
    assert b.blocks.num_cached == 4 and seq.num_cached_tokens == 16
    st = b.cache.stats()
    assert (st.queries, st.hits, st.pulled) == (8 + 18, 16, 8)
    batch = b.schedule()
    (s,) = batch.seqs
    assert s.start_pos == 16 and s.token_ids == prompt[16:] and s.block_table[:4] == table
    b.postprocess(batch, {seq.seq_id: 7})
    b.abort(seq.seq_id)
    b.check_blocks()
    again = _seq(prompt)  # the pulled blocks serve the next request on this node
    b.add(again)
    b.schedule()
    assert again.num_cached_tokens == 16
    b.abort(again.seq_id)
    b.check_blocks()
    assert b.blocks.num_free == b.blocks.num_blocks


def test_a_failed_or_aborted_pull_frees_its_blocks():
    b = _scheduler()
    prompt = list(range(1, 19))
    seq = _seq(prompt)
    b.add_pull(seq, 4 * BS)
    assert b.cancel_pull(seq.seq_id) is seq and not seq.block_table and seq.num_computed == 0
    b.check_blocks()
    assert b.blocks.num_cached == 0 and b.cache.queries == 0  # nothing named, the lookup not counted
    b.add(seq)  # computed as any request
    batch = b.schedule()
    assert batch.seqs[0].start_pos == 0 and seq.num_cached_tokens == 0
    b.abort(seq.seq_id)
    other = _seq(prompt)
    b.add_pull(other, 4 * BS)
    b.abort(other.seq_id)  # the client left while pulling
    assert b.admit_pulled(other.seq_id) is False and b.cancel_pull(other.seq_id) is None
    b.check_blocks()
    assert b.blocks.num_free == b.blocks.num_blocks


def test_a_pre_pull_lands_blocks_named_by_the_peers_hashes_and_lets_them_go():
    a, b = _scheduler(), _scheduler()
    prompt = list(range(1, 19))
    _cached(a, prompt)
    _cached(b, prompt[:8])  # b holds the chain's first 2 blocks already
    probe = _seq(prompt)
    a.cache.prepare(probe)
    hashes = probe.block_hashes[:4]
    key, blocks, k = b.pin_for_import(hashes)
    assert k == 2 and len(blocks) == 4 and b.blocks.num_free == 12
    b.check_blocks()
    assert b.land_import(key, hashes, k) == 2 and b.blocks.num_cached == 4
    assert key not in b.held and b.blocks.num_free == 16  # let go: cached, free
    b.check_blocks()
    seq = _seq(prompt)
    b.add(seq)
    b.schedule()
    assert seq.num_cached_tokens == 16  # a request after the pre-pull hits it
    b.abort(seq.seq_id)
    other = [h[::-1] for h in hashes]  # a chain not held: a failed pull lets its blocks go unnamed
    key, _, k = b.pin_for_import(other)
    assert k == 0 and b.release(key) and b.blocks.num_cached == 4
    b.check_blocks()
    assert b.blocks.num_free == b.blocks.num_blocks


def test_an_abort_while_kv_lands_keeps_the_blocks_until_the_transfer_ends():
    b = _scheduler()
    prompt = list(range(1, 19))
    seq = _seq(prompt)
    seq.landing = True  # a receiver writes into its blocks (a pull here; a decode node's import alike)
    table, _ = b.add_pull(seq, 4 * BS)
    b.abort(seq.seq_id)  # the client left mid-transfer
    assert b.held[seq.seq_id] == table and all(b.blocks.refs(x) == 1 for x in table)  # not reusable yet
    b.check_blocks()
    b.transfer_ended(seq)  # the receiver is done (or aborted): nothing writes them any more
    assert seq.seq_id not in b.held and b.blocks.num_free == b.blocks.num_blocks and b.blocks.num_cached == 0
    b.check_blocks()
    done = _seq(prompt)
    done.landing = True
    b.add_pull(done, 4 * BS)
    b.transfer_ended(done)  # ended before any abort: nothing held, the request goes on as usual
    assert b.admit_pulled(done.seq_id) and not b.held
    b.abort(done.seq_id)
    b.check_blocks()
    assert b.blocks.num_free == b.blocks.num_blocks
