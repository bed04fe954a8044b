"""Continuous batching with chunked prefill and preemption; plain data in and out.

Lifecycle of a request through the scheduler:

1. ``add(seq)``: refused with ``RequestTooLarge`` if prompt + max_tokens could
   never fit (the model's context or the whole KV cache); else queued WAITING.
2. ``schedule()``: running sequences first (decodes, then prefill chunks, each
   oldest first), each bringing its uncomputed tokens (one for a decode, a chunk
   of a long prompt) within the step's token budget, so a long prompt never
   stalls running decodes. When a running sequence needs a block and none is
   free, the newest running sequence not yet in this step is preempted (blocks
   freed, tokens kept, queued first to be recomputed). Then waiting sequences join while seats, budget and
   blocks last. Returns ``ScheduledBatch``: seq ids, token chunks, positions and
   block tables; never a tensor.
3. ``postprocess(batch, tokens)``: advances what was computed, appends sampled
   tokens, finishes on EOS / stop token / max_tokens and frees their blocks.
4. ``abort(seq_id)`` / ``fail(seq_ids, error)``: finish from any state, blocks freed.
5. disaggregation: a ``hold_kv`` sequence keeps its blocks at finish (``held``) until
   ``release``; ``add_imported`` allocates blocks for KV arriving from a prefill node
   (IMPORTING, never scheduled), starting from this node's own cached blocks of the prompt
   (only the rest is pulled), and ``activate`` turns it into a running decode and names the
   imported prompt blocks the prefill node computed by prefill, for later turns to hit.
6. forks (``n > 1``: one request's choices, ``SamplingParams.fork_group``): the first of a group
   to arrive leads; a later one with the same prompt waits (parked) until the leader has computed
   all but the prompt's last token, then *forks*: it shares the leader's full prompt blocks
   (reference-counted in the block manager), gets a copy of the partial one (``copies``, done by
   the runner before the next forward: copy-on-write), and computes only the prompt's last
   ``MIN_COMPUTED`` (2) tokens itself, by a prefill chunk, so its first token is sampled from its own
   logits with its own seed, and they are the numbers its request alone gets (a one-token chunk would
   run the decode path: other numbers, so a choice's text would depend on whether it arrived first). A prefill node's
   leader finishes at its first token: its blocks, held for the KV transfer, serve forks until
   released. The prompt is prefilled once; a choice that cannot fork (leader gone, prompt logprobs
   asked, a failover's replay, no free block) runs as a request of its own.
7. prefix cache (``compute.engine.prefix_cache``, on unless ``prefix_cache = False``): a sequence leaving
   WAITING with an empty table starts from the cached blocks matching its prompt (shared as forks'
   are) and computes the rest; computed full prompt blocks are named by content after each step and
   stay cached at count 0 until their memory is needed.
8. peer pull (``compute.engine.peer_blocks``): a prefix's blocks pinned for a peer to read, or pulled from one
   (for a request, or ahead of it) and named here.

Because every admitted request fits alone, preemption always lets the oldest
running sequence progress: the scheduler cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from compute.engine.block_manager import BlockManager
from compute.engine.peer_blocks import PeerBlocks, pin_keys
from compute.engine.prefix_cache import PrefixCache
from compute.engine.prefix_hash import MIN_COMPUTED
from compute.engine.sequence import FinishReason, Sequence, Status
from compute.errors import RequestTooLarge


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one engine's batching."""

    num_blocks: int  # KV blocks in the cache
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 32  # running sequences at most
    max_num_batched_tokens: int = 256  # tokens per step (the prefill chunk budget)
    max_model_len: int = 2048  # the model's context
    eos_token_ids: tuple[int, ...] = ()  # finish on these unless a request ignores EOS
    prefix_cache: bool = True  # reuse full KV blocks by content (compute.engine.prefix_cache)
    cache_extra: tuple[str, ...] = ()  # what else names a block's numbers (compute.engine.prefix_hash.extra_keys)

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError(f"scheduler limits must be positive: {self}")


@dataclass(slots=True)
class ScheduledSeq:
    """What one sequence runs this step."""

    seq_id: int
    token_ids: list[int]  # tokens to compute
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # a copy, covering start_pos + len(token_ids)
    sample: bool  # this chunk reaches the end: a token is sampled from its logits


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # seq ids sent back to waiting this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy before the forward

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler(PeerBlocks):
    """nano-vllm's verbs: add / schedule / postprocess / abort (+ fail); a peer's blocks: ``PeerBlocks``."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.cache = PrefixCache(self.blocks, config.prefix_cache, config.cache_extra)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.max_len = min(config.max_model_len, self.blocks.capacity_tokens)
        self.num_preemptions = 0  # since start: a metric of cache pressure
        self.held: dict[int, list[int]] = {}  # seq id -> blocks kept for a KV transfer
        self.importing: dict[int, Sequence] = {}  # decode side: blocks allocated, KV in flight
        self.leaders: dict[str, Sequence] = {}  # fork group -> the sequence that computes its prompt
        self.parked: dict[int, list[Sequence]] = {}  # leader seq id -> choices waiting for its prompt
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next batch
        self.num_forked = 0  # since start: choices that shared a prompt instead of computing it
        self._pins = pin_keys()  # keys of ``held`` lists pinned for a peer (seq ids are >= 0)

    def add(self, seq: Sequence) -> None:
        need = seq.num_prompt_tokens + seq.params.max_tokens
        if need > self.max_len:
            raise RequestTooLarge(
                f"request {seq.seq_id}: prompt {seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens} = {need}"
                f" tokens exceeds the limit of {self.max_len} (model context {self.config.max_model_len},"
                f" KV cache {self.blocks.capacity_tokens})"
            )
        seq.status = Status.WAITING
        self.seqs[seq.seq_id] = seq
        self.cache.prepare(seq)
        if not self._join(seq):
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return any(s.status is not Status.IMPORTING for s in self.seqs.values())

    # -- disaggregation ------------------------------------------------------------------------

    def release(self, seq_id: int) -> bool:
        """Free the blocks a finished ``hold_kv`` sequence kept; False if none were held."""
        blocks = self.held.pop(seq_id, None)
        if blocks is None:
            return False
        self.blocks.release(blocks)
        self.leaders = {g: q for g, q in self.leaders.items() if q.seq_id != seq_id}  # no blocks left to fork from
        return True

    def add_imported(self, seq: Sequence, num_cached: int, cacheable: int = 0) -> tuple[list[int], int]:
        """Allocate blocks for ``num_cached`` tokens whose KV another node computed.

        ``seq.token_ids`` is the prompt plus the first sampled token. The table starts with this
        node's cached blocks matching the prompt (``PrefixCache.lookup_imported``): returns the
        table and how many of its first blocks are already here; the KV of the others must be
        written into them. ``cacheable``: the leading blocks the sender computed by prefill (fit
        to name here at ``activate``). ``RequestTooLarge`` if it can never fit, ``CacheFull``
        (retry elsewhere) if there is no room now."""
        from compute.errors import CacheFull

        need = seq.num_prompt_tokens + seq.params.max_tokens
        if need > self.max_len:
            raise RequestTooLarge(f"request {seq.seq_id}: {need} tokens exceed the limit of {self.max_len}")
        self.cache.prepare(seq)
        hit = self.cache.lookup_imported(seq, num_cached)
        if not self.blocks.can_allocate(seq, num_cached + 1, hit):
            raise CacheFull(f"no free KV blocks for {num_cached} imported tokens")
        self.cache.take_imported(seq, hit, cacheable)
        self.blocks.allocate(seq, num_cached)
        seq.num_computed = num_cached
        seq.status = Status.IMPORTING
        self.importing[seq.seq_id] = seq
        self.seqs[seq.seq_id] = seq
        return list(seq.block_table), len(hit)

    def activate(self, seq_id: int) -> bool:
        """The imported KV has landed: the sequence joins the running batch as a decode."""
        seq = self.importing.pop(seq_id, None)
        if seq is None:
            return False
        self.cache.computed(seq, 0, seq.num_computed)  # the landed prompt blocks fit to name: cached here
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def schedule(self) -> ScheduledBatch:
        out, budget = ScheduledBatch(), self.config.max_num_batched_tokens
        out.copies, self.copies = self.copies, []
        taken: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):  # decodes first, then oldest
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed + n):
                victim = next(s for s in reversed(self.running) if s.seq_id not in taken)  # newest first
                self._preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            budget -= self._take(seq, n, out)  # 0: a one-token piece of a prefill waits for the next step
            taken.add(seq.seq_id)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            fresh = not seq.block_table and not seq.num_computed  # not a fork: it may start from cached blocks
            hit = self.cache.lookup(seq) if fresh else []
            start = len(hit) * self.config.block_size if fresh else seq.num_computed
            n = min(seq.num_tokens - start, budget)
            if (n == 1 < seq.num_tokens - start and self._waits_for_budget) or not self.blocks.can_allocate(
                    seq, start + n, hit):  # fmt: skip
                break  # (a prefill's one-token piece: the next step, see ``_take``)
            self.waiting.popleft()
            if fresh:
                self.cache.take(seq, hit)
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._take(seq, n, out)
        return out

    def postprocess(self, batch: ScheduledBatch, tokens: dict[int, int]) -> list[Sequence]:
        """Advance the computed sequences; ``tokens[seq_id]`` for each sampled one. Returns those finished."""
        finished = []
        for s in batch.seqs:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue  # aborted or failed meanwhile
            seq.num_computed = max(seq.num_computed, s.start_pos + len(s.token_ids))
            self.cache.computed(seq, s.start_pos, len(s.token_ids))
            if seq.seq_id in self.parked and seq.num_computed >= seq.num_prompt_tokens - 1:
                self._fork_parked(seq)  # before a finish can free the prompt's blocks
            if not s.sample:
                continue
            tok = tokens[s.seq_id]
            seq.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish ``seq_id`` wherever it is; unknown or finished ids are ignored."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    def fail(self, seq_ids: list[int], error: str) -> list[Sequence]:
        """Finish ``seq_ids`` with an error (their step failed); the others live on."""
        failed = []
        for sid in seq_ids:
            seq = self.seqs.get(sid)
            if seq is not None:
                seq.error = error
                self._finish(seq, FinishReason.ERROR)
                failed.append(seq)
        return failed

    def check_blocks(self) -> None:
        """Assert the block manager's invariants against every table and held list (tests)."""
        self.blocks.check([q.block_table for q in self.seqs.values()] + list(self.held.values()))

    # -- internals ---------------------------------------------------------------------------

    def _take(self, seq: Sequence, n: int, out: ScheduledBatch) -> int:
        """Schedule ``n`` of ``seq``'s tokens (fewer, see below); returns how many."""
        prefill_end = seq.num_tokens
        if seq.replay_from is not None:  # replayed output: one token per step, like the decode that made it
            r = seq.replay_from
            n = 1 if seq.num_computed >= r else min(n, r - seq.num_computed)
            prefill_end = max(r, seq.num_computed + 1)
        if n > 1 and prefill_end - (seq.num_computed + n) == 1:
            n -= 1  # never leave one prefill token for a chunk of its own: it would run the decode path (other
            # numbers: a prompt's logits would depend on where the budget cut it; compute/engine/prefix_cache.py)
        if n == 1 < prefill_end - seq.num_computed and self._waits_for_budget:
            return 0  # nor take one of a longer prefill (a budget down to 1): the whole chunk next step
        end = seq.num_computed + n
        self.blocks.allocate(seq, end)
        chunk = seq.token_ids[seq.num_computed : end]
        out.seqs.append(ScheduledSeq(seq.seq_id, chunk, seq.num_computed, list(seq.block_table), end == seq.num_tokens))
        return n

    @property
    def _waits_for_budget(self) -> bool:
        """A prefill left one token of the step's budget waits for the next step, where it gets two at least: the
        decodes of the other seats leave that much (else it takes the one token: progress before numbers)."""
        return self.config.max_num_batched_tokens > self.config.max_num_seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self.cache.reset(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.config.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is Status.WAITING:  # parked behind a leader
            for group in self.parked.values():
                if seq in group:
                    group.remove(seq)
                    break
        elif seq.status is Status.IMPORTING:
            self.importing.pop(seq.seq_id, None)
        if seq.hold_kv and reason in (FinishReason.STOP, FinishReason.LENGTH) and seq.block_table:
            self.held[seq.seq_id], seq.block_table = seq.block_table, []
        elif seq.landing and seq.block_table:  # a KV transfer may still write them: freed at ``transfer_ended``
            self.held[seq.seq_id], seq.block_table = seq.block_table, []
        else:
            self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.seqs.pop(seq.seq_id, None)
        group = seq.params.fork_group
        if group and self.leaders.get(group) is seq and seq.seq_id not in self.held:
            del self.leaders[group]  # held blocks still serve forks, until ``release``
        self.waiting.extend(self.parked.pop(seq.seq_id, []))  # a leader gone early: they compute their own

    # -- forks (n > 1) ------------------------------------------------------------------------

    def _join(self, seq: Sequence) -> bool:
        """A fork group's member: fork from its leader now, or park until the leader's prompt is
        computed. False: it runs on its own (and leads its group if nobody does)."""
        group = seq.params.fork_group
        if (not group or seq.params.prompt_logprobs is not None or seq.replay_from is not None
                or seq.num_prompt_tokens <= MIN_COMPUTED):  # nothing to share
            return False
        lead = self.leaders.get(group)
        if lead is None:
            self.leaders[group] = seq
            return False
        n = seq.num_prompt_tokens
        if lead.num_prompt_tokens != n or lead.token_ids[:n] != seq.token_ids or lead.status is Status.IMPORTING:
            return False
        if lead.status is Status.FINISHED:  # a prefill node's leader: its blocks are held for the transfer
            return lead.seq_id in self.held and self._fork(lead, seq, self.held[lead.seq_id])
        if lead.status is Status.RUNNING and lead.num_computed >= n - 1:
            return self._fork(lead, seq, lead.block_table)
        self.parked.setdefault(lead.seq_id, []).append(seq)
        return True

    def _fork_parked(self, lead: Sequence) -> None:
        for seq in self.parked.pop(lead.seq_id, []):
            if not self._fork(lead, seq, lead.block_table):
                self.waiting.append(seq)

    def _fork(self, lead: Sequence, seq: Sequence, blocks: list[int]) -> bool:
        """``seq`` shares ``blocks`` (``lead``'s prompt) but its last ``MIN_COMPUTED`` tokens', which it computes
        itself by a prefill chunk (``_take`` never cuts it to one token): under ``kernels = invariant`` the numbers
        of its request alone, whichever choice leads (compute/engine/prefix_cache.py, the same rule for a hit)."""
        shared = seq.num_prompt_tokens - MIN_COMPUTED
        full, partial = divmod(shared, self.config.block_size)
        if partial and not self.blocks.num_free:
            return False
        self.blocks.share(blocks[:full], seq)
        if partial:  # copy-on-write: the block the fork goes on writing in is its own
            self.blocks.allocate(seq, shared)
            self.copies.append((blocks[full], seq.block_table[full]))
        seq.num_computed = shared
        seq.num_published = full  # the leader's blocks (published by the leader, if fit)
        seq.num_cached_tokens = lead.num_cached_tokens  # one request: its choices report the prompt's hit
        self.waiting.appendleft(seq)  # next, within the step's seats and budget
        self.num_forked += 1
        return True
