"""Model runner: a scheduled batch (plain data) -> one forward -> sampled tokens.

The only place where the scheduler's lists become tensors (built on the host, moved
once to the cache's device). Owns the model, its paged KV cache and the sampler.
"""

from __future__ import annotations

from typing import NamedTuple

from compute.engine.cuda_graphs import CudaGraphs
from compute.engine.sampling import History, Sampler, TokenLogprobs, token_logprobs
from compute.engine.scheduler import ScheduledBatch
from compute.engine.sequence import Sequence
from compute.engine.step_graphs import StepGraphs
from compute.modeling.batch import ForwardBatch
from compute.modeling.kv_cache import KVCache
from compute.modeling.lora import LoraRows
from compute.modeling.model import Transformer


class StepResult(NamedTuple):
    tokens: dict[int, int]  # seq_id -> sampled token (sequences whose chunk reached the end)
    logprobs: dict[int, TokenLogprobs]  # seq_id -> its sampled token's logprobs, if asked for
    prompt_logprobs: dict[int, list]  # seq_id -> its whole prompt's logprobs, the step its prompt completed


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache, sampler: Sampler | None = None) -> None:
        self.model, self.cache = model, cache
        self.sampler = sampler or Sampler()
        self.graphs: StepGraphs | CudaGraphs | None = None  # compiled/captured decode steps ([node] step = graph)
        self._lora: LoraRows | None = None  # the last step's rows by adapter: a decode step like it reuses its calls

    def forward(self, batch: ScheduledBatch, scored: list[bool], loras: list | None = None):
        """Logits of ``batch``: a pure-decode batch through a compiled step graph where one covers it, else eager
        (always with an adapter: ``loras``, each sequence's LoraWeights or None, compute/modeling/lora.py)."""
        # sorted by run(); steady decode repeats the last step's groups (and their prepared calls)
        lora = LoraRows.of(loras, [len(s.token_ids) for s in batch.seqs], self._lora) if loras else None
        self._lora = lora  # (None after a step without adapters: no evicted adapter kept alive here)
        if (self.graphs is not None and lora is None and not any(scored)
                and all(len(s.token_ids) == 1 for s in batch.seqs)):  # fmt: skip
            logits = self.graphs.decode([s.token_ids[0] for s in batch.seqs], [s.start_pos for s in batch.seqs],
                                        [s.block_table for s in batch.seqs], self.cache)  # fmt: skip
            if logits is not None:
                return logits
        fb = ForwardBatch.build(
            [s.token_ids for s in batch.seqs],
            [s.start_pos for s in batch.seqs],
            [s.block_table for s in batch.seqs],
            self.cache.block_size,
            all_logits=scored,
        )
        fb.lora = lora
        return self.model(fb.to(self.cache.device), self.cache)  # [rows, V]: the last token of each, every token of a scored chunk

    def run(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> StepResult:
        """Compute every scheduled chunk and sample where a chunk reached the end of its sequence."""
        loras = [seqs[s.seq_id].lora for s in batch.seqs]
        if any(w is not None for w in loras):  # each adapter's rows together: a slice per adapter, no gathers
            order = sorted(range(len(loras)), key=lambda i: 0 if loras[i] is None else id(loras[i]))
            batch.seqs[:] = [batch.seqs[i] for i in order]
            loras = [loras[i] for i in order]
        scored = [_scores_prompt(seqs[s.seq_id], s.start_pos) for s in batch.seqs]
        logits = self.forward(batch, scored, loras)
        last, start = [], 0  # each chunk's last logits row
        prompts: dict[int, list] = {}
        for s, full in zip(batch.seqs, scored):
            n = len(s.token_ids) if full else 1
            if full:
                self._score(seqs[s.seq_id], s.start_pos, logits[start : start + n])
            start += n
            last.append(start - 1)
        rows = [i for i, s in enumerate(batch.seqs) if s.sample]
        if not rows:
            return StepResult({}, {}, {})
        owners = [seqs[batch.seqs[i].seq_id] for i in rows]
        out = self.sampler.sample(logits[[last[i] for i in rows]], [q.params for q in owners],
                                  [q.num_tokens for q in owners],
                                  [History(q.token_ids, q.prompt_len) for q in owners],
                                  [q.matcher for q in owners])  # fmt: skip
        lps = {q.seq_id: lp for q, lp in zip(owners, out.logprobs) if lp is not None}
        for q in owners:  # with the first token this node samples for it (not again after a preemption)
            if q.params.prompt_logprobs is not None and q.num_tokens == q.num_prompt_tokens:
                prompts[q.seq_id] = (q.prompt_logprobs or [None])[: q.prompt_len]
        return StepResult({q.seq_id: t for q, t in zip(owners, out.tokens)}, lps, prompts)

    @staticmethod
    def _score(seq: Sequence, start: int, logits) -> None:
        """Row j of ``logits`` ([q, V]) predicts the token at ``start + j + 1``: record the prompt's ones, in order."""
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
        first = len(seq.prompt_logprobs) - 1 - start  # rows before it were recorded (a recompute after preemption)
        stop = min(logits.shape[0], seq.prompt_len - 1 - start)
        if first >= stop:
            return
        targets = seq.token_ids[start + first + 1 : start + stop + 1]
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs.extend(token_logprobs(logits[first:stop], targets, [k] * len(targets)))


def _scores_prompt(seq: Sequence, start: int) -> bool:
    """The chunk at ``start`` holds prompt positions whose logprobs are still to record."""
    return seq.params.prompt_logprobs is not None and start < seq.prompt_len - 1 and (
        len(seq.prompt_logprobs) < seq.prompt_len)
