"""The engine loop: requests in, token ids out. One step is schedule, run, postprocess.

A step whose forward raises fails only the requests in that step (their blocks
are freed, ``finish_reason`` is ERROR with the message); the engine lives on.
Tokenization, stop strings and streaming text are the caller's layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compute.modeling.kv_cache import KVCache, kv_dtype
from compute.modeling.model import Transformer
from compute.engine.prefix_cache import PrefixCacheStats
from compute.engine.prefix_hash import extra_keys
from compute.engine.runner import ModelRunner
from compute.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import Sequence


@dataclass(slots=True)
class StepOutput:
    """What one request got from one step."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per new token, if the request asked
    prompt_logprobs: list | None = None  # with the first token, if asked: None then TokenLogprobs per prompt token
    cached_tokens: int | None = None  # with the first token: prompt tokens taken from the prefix cache


class Engine:
    def __init__(self, model: Transformer, config: SchedulerConfig, sampler: Sampler | None = None,
                 kv_cache_dtype: str = "auto", cache_key: str = "") -> None:  # fmt: skip
        """``cache_key``: the model's identity in prefix-cache hashes (reference@version and runtime weights: what
        else changes a block's numbers); the KV dtype and block size are added here."""
        dtype = kv_dtype(kv_cache_dtype, model.dtype, bool(model.kernel_modules()))
        if not config.cache_extra:  # a block's numbers depend on the model and the cache's dtype and block size
            config.cache_extra = extra_keys(cache_key, str(dtype).removeprefix("torch."), config.block_size)
        self.scheduler = Scheduler(config)
        cache = KVCache(model.config, config.num_blocks, config.block_size, dtype, model.device)
        self.runner = ModelRunner(model, cache, sampler or Sampler(eos_token_ids=tuple(config.eos_token_ids or ())))
        self.last_step = (0, 0)  # (sequences decoding, prompt tokens prefilled) in the last step
        self.prompt_tokens_computed = 0  # since start: the requests' own prompt positions run through the model (forks
        # share theirs; a decode node's first token and a failover's replayed output are output, not prompt)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.scheduler.cache.stats()

    def clear_prefix_cache(self) -> int:
        """Forget every cached block's name (the KV numbers changed: another kernel plan); returns how many."""
        return self.scheduler.blocks.clear()

    def drain_cache_events(self) -> list:
        """The prefix cache's events since the last drain (``compute.engine.block_manager.CacheEvent``)."""
        return self.scheduler.blocks.drain_events()

    @classmethod
    def for_model(cls, model: Transformer, num_blocks: int, kv_cache_dtype: str = "auto", cache_key: str = "",
                  **kw) -> Engine:  # fmt: skip
        """An engine with the model's context and EOS ids filled in (``kw``: ``SchedulerConfig``)."""
        kw.setdefault("max_model_len", model.config.max_position_embeddings)
        kw.setdefault("eos_token_ids", model.config.eos_token_ids)
        return cls(model, SchedulerConfig(num_blocks=num_blocks, **kw), kv_cache_dtype=kv_cache_dtype,
                   cache_key=cache_key)  # fmt: skip

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; ``RequestTooLarge`` if it can never fit. Returns its id."""
        seq = Sequence(prompt_token_ids, params or SamplingParams())
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        self.runner.cache.copy_blocks(batch.copies)  # forks' partial prompt blocks, before anything writes them
        decodes = sum(len(s.token_ids) == 1 for s in batch.seqs)
        self.last_step = (decodes, batch.num_tokens - decodes)
        if not batch:
            return []
        seqs = self.scheduler.seqs
        self.prompt_tokens_computed += sum(max(0, min(s.start_pos + len(s.token_ids), seqs[s.seq_id].prompt_len)
                                               - s.start_pos) for s in batch.seqs)  # fmt: skip
        try:
            res = self.runner.run(batch, self.scheduler.seqs)
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the engine
            failed = self.scheduler.fail([s.seq_id for s in batch.seqs], f"{type(e).__name__}: {e}")
            return [StepOutput(q.seq_id, [], True, q.finish_reason.value, q.error) for q in failed]
        first = {sid: seqs[sid].num_cached_tokens for sid in res.tokens  # None on a decode node (imported KV)
                 if seqs[sid].num_tokens == seqs[sid].num_prompt_tokens}  # fmt: skip
        finished = {q.seq_id: q for q in self.scheduler.postprocess(batch, res.tokens)}
        out = []
        for sid, tok in res.tokens.items():
            q = finished.get(sid)
            lp = [res.logprobs[sid]] if sid in res.logprobs else []
            out.append(StepOutput(sid, [tok], q is not None, q.finish_reason.value if q else None, logprobs=lp,
                                  prompt_logprobs=res.prompt_logprobs.get(sid), cached_tokens=first.get(sid)))  # fmt: skip
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run ``prompts`` to completion together; returns each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.seq_id in outputs:
                    outputs[o.seq_id].extend(o.new_token_ids)
        return [outputs[i] for i in ids]
