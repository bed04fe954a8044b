"""Model runner: a scheduled batch (plain data) -> one forward -> sampled tokens.

The only place where the scheduler's lists become tensors (built on the host, moved
once to the cache's device). Owns the model, its paged KV cache and the sampler.
"""

from __future__ import annotations

from compute.batch import ForwardBatch
from compute.kv_cache import KVCache
from compute.model import Transformer
from compute.sampling import Sampler
from compute.scheduler import ScheduledBatch
from compute.sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, sampler: Sampler | None = None) -> None:
        self.model, self.cache = model, cache
        self.sampler = sampler or Sampler()

    def run(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> dict[int, int]:
        """Compute every scheduled chunk; returns ``{seq_id: token}`` for those that sample."""
        fb = ForwardBatch.build(
            [s.token_ids for s in batch.seqs],
            [s.start_pos for s in batch.seqs],
            [s.block_table for s in batch.seqs],
            self.cache.block_size,
        ).to(self.cache.device)
        logits = self.model(fb, self.cache)  # [len(batch.seqs), V]: last token of each
        rows = [i for i, s in enumerate(batch.seqs) if s.sample]
        if not rows:
            return {}
        owners = [seqs[batch.seqs[i].seq_id] for i in rows]
        tokens = self.sampler(logits[rows], [q.params for q in owners], [q.num_tokens for q in owners])
        return {q.seq_id: t for q, t in zip(owners, tokens)}
