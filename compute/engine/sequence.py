"""A request inside the engine: its tokens, its KV blocks and where it stands.

Lifecycle::

    WAITING --schedule--> RUNNING --postprocess--> FINISHED (stop | length)
       ^                     |
       +----- preempt -------+        abort / fail: any state -> FINISHED
    IMPORTING --activate--> RUNNING   (decode role: blocks allocated, KV arriving from a prefill node)

A prefill-role sequence sets ``hold_kv``: when it finishes, its blocks are held
(not freed) until the decode side has pulled them, then ``release``d.

``num_computed`` counts tokens whose K/V are in the cache. A step runs the
tokens ``token_ids[num_computed:]`` (or a chunk of them); when it reaches the
end it yields logits and one new token is appended. Prefill, chunked prefill,
decode and recompute after preemption are all this one rule.
"""

from __future__ import annotations

import enum
import itertools

from compute.engine.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    IMPORTING = "importing"  # blocks allocated, waiting for KV from a prefill node
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client went away
    ERROR = "error"  # the step that ran it failed


class Sequence:
    """One request's tokens and KV bookkeeping; no tensors."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose K/V are cached
        self.num_preemptions = 0
        self.hold_kv = False  # prefill role: keep the blocks at finish for a KV transfer
        # failover: prompt positions from here on are earlier *output*, recomputed one token per
        # step (as decode computed them) so the continuation is bit-identical to the lost stream
        self.replay_from: int | None = None
        # token_ids[prompt_len:] were generated: lower than num_prompt_tokens on a node that got earlier
        # output inside its prompt (a decode node's first token, a failover's replay): penalties and
        # min_tokens count them as output wherever the request runs
        self.prompt_len = len(prompt_token_ids)
        self.prompt_logprobs: list = []  # params.prompt_logprobs: per prompt token, None for the first
        self.matcher = None  # params.grammar: its matcher (compute.engine.grammar), advanced by the sampler
        self.lora = None  # params.adapter: its LoraWeights (compute.modeling.lora), attached by the node
        # prefix cache (compute.engine.prefix_cache): the chained hashes of the prompt's full blocks, how many of this
        # table's blocks are named by them, where KV fit to share ends (positions computed one token a step went
        # down the decode path: other numbers than a prefill's), and the tokens a hit gave it on first admission
        self.block_hashes: list[bytes] = []
        self.num_published = 0
        self.cache_stop = self.prompt_len
        self.num_cached_tokens: int | None = None
        # a KV transfer writes this sequence's blocks (decode import, peer pull): finishing meanwhile (an abort) holds
        # the blocks until the scheduler's ``transfer_ended``, so they are not reused while the receiver writes
        self.landing = False

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, {self.num_tokens} tokens, {self.num_computed} cached)"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int) -> None:
        self.token_ids.append(token)
