"""Automatic prefix caching: the scheduler's rules for which KV blocks are found and kept by content.

Lifecycle of a request's blocks through the cache (the block manager keeps the blocks; this module
decides which are named and which are taken):

1. ``prepare`` (``Scheduler.add``): the chained hashes of the prompt's full blocks
   (``compute.engine.prefix_hash``, with the engine's extra keys and the request's ``hash_salt``: its cache salt and adapter).
2. ``lookup`` (when the sequence leaves WAITING with an empty table: first admission or after a
   preemption): the longest run of cached blocks matching the prompt, cut so that at least
   ``MIN_COMPUTED`` tokens are left to compute (``_usable``); the table starts with them (the block
   manager's ``share``: the same counting as ``n > 1`` forks) and ``num_computed`` skips them.
3. ``publish`` (after each step): full blocks whose K/V the sequence has now computed by a prefill
   (prompt positions, before ``cache_stop``) get their hash: later prompts can take them.
   On a decode node (``lookup_imported`` / ``take_imported``): a request's
   imported KV starts from this node's own cached blocks of the prompt (only the rest is pulled);
   once it has landed, the imported full prompt blocks the *prefill node* computed by prefill
   (``cacheable``, its ``cache_stop``) are named here too, so turn N of a conversation finds
   turn N-1's prompt on the decode node that decoded it.
4. finish / abort / preemption / ``release`` of held KV: the blocks' counts drop; a named block at
   count 0 stays cached (its hash kept) until ``allocate`` needs its memory (LRU, tail first).

Determinism (``kernels = invariant``): a hit must give the numbers a miss gives. Under that mode a
row's K/V and logits do not depend on how its prefill is chunked (compute/modeling/attention.py aligns query
blocks to absolute positions; every linear is row-invariant), so a match may end at any block
boundary, with two exceptions this module closes:

- a chunk of *one* token runs the decode path (``ForwardBatch.plan``: another attention kernel,
  other rounding). A hit that left only the last prompt token to compute would make that token's
  logits differ from a miss's: ``_usable`` leaves at least ``MIN_COMPUTED`` = 2 tokens (one block
  less in the ``len % block_size == 1`` case). A fork (``n > 1``) computes its prompt's last
  ``MIN_COMPUTED`` tokens itself for the same reason, and the scheduler never cuts a prefill to a
  one-token chunk where its budget allows (``Scheduler._take``).
- K/V computed one token a step (decode output — on a decode node too: its decoded answer is
  never cached, the next turn pulls it from the prefill node, which recomputed it by prefill — a failover's replay, a
  chunk a small budget cut to one token) carry those other numbers: they are never published. Only
  prompt positions computed by a prefill chunk are (``cache_stop``). A multi-turn conversation so
  hits turn N-1's prompt and recomputes its (short) answer, which the next turn then hits.

In the default (``measured``) mode a node picks kernels per batch size (M bucket) and SDPA's query
blocking follows the chunk: a hit computes the suffix in another chunk shape than a miss, so its
numbers (and perhaps a greedy token) may differ, as in vLLM and SGLang. A request asking for prompt
logprobs takes no cached blocks (it needs every prompt row's logits) but publishes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from compute.engine.block_manager import BlockManager
from compute.engine.prefix_hash import MIN_COMPUTED, block_hashes
from compute.engine.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` are in tokens too)."""

    queries: int = 0  # prompt tokens looked up (each admission from WAITING with an empty table)
    hits: int = 0  # of them, found cached (taken instead of computed)
    cached_blocks: int = 0  # blocks named now (free or held)
    evictions: int = 0  # cached blocks reused for other content
    pulled: int = 0  # of the hits, tokens whose blocks came from a peer's cache


class PrefixCache:
    """The rules between a scheduler and its block manager; ``enabled = False``: no hash, no hit, no publish."""

    def __init__(self, blocks: BlockManager, enabled: bool = True, extra: tuple[str, ...] = ()) -> None:
        self.blocks, self.enabled, self.extra = blocks, enabled, tuple(extra)
        self.bs = blocks.block_size
        self.queries = self.hits = 0
        self.pulled = 0  # of the hits, prompt tokens whose blocks were pulled from a peer (``landed``)

    def prepare(self, seq: Sequence) -> None:
        """Hash the prompt's full blocks (positions before ``prompt_len``: replayed output is not prompt)."""
        seq.cache_stop = seq.prompt_len
        seq.num_published = 0
        if self.enabled:
            seq.block_hashes = block_hashes(seq.token_ids[: seq.prompt_len], self.bs, self.extra,
                                            seq.params.hash_salt)  # fmt: skip

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` can start from (an empty table, nothing computed); counts the query."""
        if not self.enabled or seq.block_table or seq.num_computed or seq.params.prompt_logprobs is not None:
            return []
        return self.blocks.match(seq.block_hashes[: self._usable(seq)])

    def take(self, seq: Sequence, hit: list[int]) -> None:
        """``seq`` starts from ``hit`` (``lookup``'s answer, admitted): shared, not computed."""
        if seq.num_cached_tokens is None:  # what the request is told: its first admission's hit
            seq.num_cached_tokens = len(hit) * self.bs
        if self._share(seq, hit):
            seq.num_computed = len(hit) * self.bs

    def lookup_imported(self, seq: Sequence, num_imported: int) -> list[int]:
        """Decode side: the cached blocks an imported prompt (``num_imported`` tokens' KV on the way) starts
        from. Any full prompt block may hit: the decode node computes its first token by the decode path
        whatever the hit, so no ``MIN_COMPUTED`` cut (unlike ``lookup``)."""
        if not self.enabled or seq.block_table or seq.num_computed:
            return []
        return self.blocks.match(seq.block_hashes[: num_imported // self.bs])

    def take_imported(self, seq: Sequence, hit: list[int], cacheable: int) -> None:
        """Decode side: ``seq`` starts from ``hit`` (not pulled); the imported blocks before ``cacheable``
        (the prefill node's prefill-computed full blocks) are named at ``computed`` once they landed."""
        seq.cache_stop = min(seq.prompt_len, max(cacheable, len(hit)) * self.bs)  # never name the decode path's
        self._share(seq, hit)

    def landed(self, seq: Sequence) -> None:
        """A prefix pulled from a peer (``take_imported``, ``uncount``, then the transfer) is in ``seq``'s table:
        its blocks are named (the peer computed them by prefill and named them by these hashes), the lookup is
        counted now with them as hits (taken, not computed; ``pulled``: how many came from the peer), and the
        rest of the prompt is computed (and published) as any prompt's."""
        if not self.enabled:
            return
        local = seq.num_published * self.bs  # this node's own hit (``take_imported`` shared it)
        self.computed(seq, 0, seq.num_computed)
        self.queries += seq.prompt_len
        self.hits += seq.num_computed
        self.pulled += seq.num_computed - local
        seq.num_cached_tokens = seq.num_computed
        seq.cache_stop = seq.prompt_len

    def uncount(self, seq: Sequence) -> None:
        """Take back ``take_imported``'s count of a pull's lookup: ``landed`` counts it, or (the pull failed)
        the lookup of the sequence added again does."""
        if self.enabled:
            self.queries -= seq.prompt_len
            self.hits -= seq.num_published * self.bs

    def _share(self, seq: Sequence, hit: list[int]) -> bool:
        """Count the lookup and start ``seq``'s table with ``hit``; whether it shared any block."""
        if not self.enabled:
            return False
        self.queries += seq.prompt_len
        self.hits += len(hit) * self.bs
        if hit:
            self.blocks.share(hit, seq)
            seq.num_published = len(hit)
        return bool(hit)

    def computed(self, seq: Sequence, start: int, n: int) -> None:
        """``seq`` computed ``n`` tokens from ``start``: publish the full prefill-computed prompt blocks."""
        if not self.enabled:
            return
        if n == 1 and start < seq.cache_stop:
            seq.cache_stop = start  # one token a step: decode-path numbers from here on
        fit = min(seq.num_computed, seq.cache_stop) // self.bs
        fit = min(fit, len(seq.block_hashes), len(seq.block_table))
        if fit > seq.num_published:
            self.blocks.publish(seq.block_table[seq.num_published : fit], seq.block_hashes[seq.num_published : fit])
            seq.num_published = fit

    def reset(self, seq: Sequence) -> None:
        """``seq`` lost its table (preempted): it will look up again and recompute by prefill."""
        seq.num_published = 0
        seq.cache_stop = seq.prompt_len

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, self.blocks.num_cached, self.blocks.evictions, self.pulled)

    def _usable(self, seq: Sequence) -> int:
        """Blocks a hit may cover: every token before it prompt, at least ``MIN_COMPUTED`` tokens after it."""
        return min(len(seq.block_hashes), (seq.num_tokens - MIN_COMPUTED) // self.bs)
