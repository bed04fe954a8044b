"""The engine loop: requests in, token ids out. One step is schedule, run, postprocess.

A step whose forward raises fails only the requests in that step (their blocks
are freed, ``finish_reason`` is ERROR with the message); the engine lives on.
Tokenization, stop strings and streaming text are the caller's layer.

The verbs a node calls (on the engine thread; compute/node never touches the scheduler):
  requests      add, abort, has_unfinished, step
  held KV       held_blocks, release                    a prefill node's blocks kept for a decode node
  imported KV   import_prompt, activate, transfer_ended  a decode node's prompt whose KV another node computed
  peer blocks   pin_cached, add_pull, admit_pulled, cancel_pull, pin_for_import, land_import
  naming        prompt_hashes, block_size, max_len, cache_extra, prefix_cache_enabled
  reading       stats, prefix_cache_stats, drain_cache_events, cached_hashes, events_dropped
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compute.engine.prefix_cache import PrefixCacheStats
from compute.engine.prefix_hash import extra_keys, prompt_hashes
from compute.engine.runner import ModelRunner
from compute.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from compute.engine.scheduler import Scheduler, SchedulerConfig
from compute.engine.sequence import Sequence, Status
from compute.modeling.kv_cache import KVCache, kv_dtype
from compute.modeling.model import Transformer


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

    @property
    def events_dropped(self) -> int:
        """Cache events the bounded queue dropped since start (a consumer's gap)."""
        return self.scheduler.blocks.events_dropped

    def cached_hashes(self) -> list[bytes]:
        """Every block hash cached now (a consumer's snapshot)."""
        return self.scheduler.blocks.cached_hashes()

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
        self.add(seq)
        return seq.seq_id

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ``RequestTooLarge`` if it can never fit."""
        self.scheduler.add(seq)

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    # -- KV that crosses nodes (compute/engine/peer_blocks.py, scheduler.py: the contracts) ----------

    def held_blocks(self, seq_id: int) -> list[int]:
        """The blocks a finished ``hold_kv`` sequence keeps (a prefill node's, offered to a decode node)."""
        return list(self.scheduler.held.get(seq_id, []))

    def release(self, key: int) -> bool:
        """Let go of held blocks (a finished prefill's seq id, or a pin's key)."""
        return self.scheduler.release(key)

    def import_prompt(self, seq: Sequence, num_tokens: int, cacheable: int = 0) -> tuple[list[int], int]:
        """Blocks for ``num_tokens`` of prompt KV another node computed: (table, blocks already here)."""
        return self.scheduler.add_imported(seq, num_tokens, cacheable)

    def activate(self, seq_id: int) -> bool:
        return self.scheduler.activate(seq_id)

    def transfer_ended(self, seq: Sequence) -> None:
        self.scheduler.transfer_ended(seq)

    def pin_cached(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        return self.scheduler.pin_cached(hashes)

    def add_pull(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int]:
        return self.scheduler.add_pull(seq, num_tokens)

    def admit_pulled(self, seq_id: int) -> bool:
        return self.scheduler.admit_pulled(seq_id)

    def cancel_pull(self, seq_id: int) -> Sequence | None:
        return self.scheduler.cancel_pull(seq_id)

    def pin_for_import(self, hashes: list[bytes]) -> tuple[int, list[int], int]:
        return self.scheduler.pin_for_import(hashes)

    def land_import(self, key: int, hashes: list[bytes], k: int) -> int:
        return self.scheduler.land_import(key, hashes, k)

    # -- naming and reading (any thread: plain reads of lists, as a scrape does) ---------------------

    @property
    def block_size(self) -> int:
        return self.scheduler.config.block_size

    @property
    def max_len(self) -> int:
        """Prompt + max_tokens of one request, at most (the model's context or the whole KV cache)."""
        return self.scheduler.max_len

    @property
    def cache_extra(self) -> tuple[str, ...]:
        return tuple(self.scheduler.cache.extra)

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.scheduler.config.prefix_cache

    def prompt_hashes(self, tokens: list[int], salt: str | None = None) -> list[bytes]:
        """The hashes of ``tokens``' blocks a hit may cover, as this engine names them."""
        return prompt_hashes(tokens, self.block_size, self.cache_extra, salt)

    def stats(self) -> dict[str, int]:
        """Queue and KV use now, by ``compute.node.protocol.EngineLoad``'s field names."""
        s, bm, pc = self.scheduler, self.scheduler.blocks, self.scheduler.cache
        waiting, running = list(s.waiting), list(s.running)
        queued = sum(q.num_uncomputed for q in waiting) + sum(q.num_uncomputed for q in running if q.num_uncomputed > 1)
        return dict(queued=len(waiting), running=sum(q.status is Status.RUNNING for q in running),
                    importing=len(s.importing), queued_prompt_tokens=queued, kv_blocks_used=bm.num_blocks - bm.num_free,
                    kv_blocks_free=bm.num_free, kv_blocks_total=bm.num_blocks,
                    kv_blocks_held=sum(len(b) for b in list(s.held.values())), kv_blocks_cached=bm.num_cached,
                    prefix_queries=pc.queries, prefix_hits=pc.hits, prefix_pulled=pc.pulled)  # fmt: skip

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
