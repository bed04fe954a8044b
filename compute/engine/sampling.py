"""Sampling parameters of a request and the sampler that turns logits into tokens (and logprobs).

One step's rows are processed together, in this order (vLLM's and the OpenAI API's meaning):

0. ``allowed_token_ids``: every other token is impossible (vLLM's meaning);
1. ``logit_bias`` added to the raw logits;
2. penalties: ``repetition_penalty`` r over every token of prompt and output (a positive logit
   divided by r, a negative one multiplied), then ``frequency_penalty`` * count and
   ``presence_penalty`` * [count > 0] subtracted for tokens of the *output* so far;
3. ``min_tokens``: EOS and the stop tokens are impossible until that many tokens were generated
   (a grammar that allows nothing but EOS, at its end, wins: the answer ends);
4. temperature 0 is greedy (argmax of the processed logits); otherwise logits / temperature,
   then top-k, softmax, top-p (nucleus) and ``min_p`` (drop tokens below min_p * the top
   probability), and one token is drawn per row.

Everything is a batched tensor op over the rows that ask for it; only the draw loops over rows
(one ``multinomial`` each, for its generator). Logprobs (``logprobs = k``) are the log-softmax of
the *raw* logits (before bias, penalties and temperature: vLLM's default), the chosen token's and
the k most likely.

A request with a ``seed`` draws the token at absolute position ``pos`` (prompt tokens count) from a
generator seeded with ``draw_seed(seed, pos)``: its tokens do not depend on what else is in the batch,
nor on *where* they are drawn — the prefill node's first token, the decode node's rest, and a
re-prefill after failover (prompt + replayed tokens) all draw at the same positions, and every node
is told which prompt tokens are earlier output (``History.prompt_len``), so penalties see the same
history; a seeded request gives the same text split or colocated. Requests without a seed share
the sampler's generator (one per device).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import torch

MAX_LOGPROBS = 20  # top logprobs per token at most (the OpenAI API's bound)


class AdapterRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The LoRA adapter a request runs: its store version and content digest (paramstore/adapters.py). The digest
    names the adapter in the prefix cache's hashes (``request_salt``): a re-imported adapter never reuses KV."""

    ref: str  # NAME@vN
    digest: str  # sha256 hex of its scalings and tensors

    def __post_init__(self) -> None:
        if "@v" not in self.ref or len(self.digest) != 64:
            raise ValueError(f"adapter must name NAME@vN and a sha256 digest, got {self.ref!r}")


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a request asks of generation: the one shape from the gateway to the sampler. The gateway builds it
    once from the API request; it travels to a node as itself (msgspec: a field the node does not know is
    refused, 400 naming it) and is checked by ``__post_init__`` wherever it is made or decoded."""

    max_tokens: int = 16  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability, [0, 1]
    seed: int | None = None  # per-request reproducible sampling
    stop_token_ids: tuple[int, ...] = ()  # finish when one is generated (kept in the output)
    ignore_eos: bool = False  # do not finish on the model's EOS ids
    presence_penalty: float = 0.0  # [-2, 2], on output tokens
    frequency_penalty: float = 0.0  # [-2, 2], on output tokens, per occurrence
    repetition_penalty: float = 1.0  # > 0, on prompt and output tokens (1 = off)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop tokens are impossible before this many generated tokens
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be drawn (vLLM; a node refuses ids past its vocab)
    logprobs: int | None = None  # None: none; k in [0, MAX_LOGPROBS]: the chosen token's + the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (prompt scoring)
    grammar: dict | None = None  # structured output (compute.engine.grammar): json_object | json_schema | regex spec
    fork_group: str | None = None  # the choices of one n > 1 request: they share the prompt's KV (compute.engine.scheduler)
    cache_salt: str | None = None  # enters the first KV block's hash: only requests with this salt share cached KV
    adapter: AdapterRef | None = None  # a LoRA adapter of the model (compute/modeling/lora.py); None: the base

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = tuple(int(t) for t in self.allowed_token_ids)
            if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (>= 0)")
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def hash_salt(self) -> str | None:
        """What enters a prompt's first block hash besides its tokens: the cache salt and the adapter's digest
        (KV computed under an adapter is that adapter's). The one reading of both, on every node and the gateway."""
        if self.adapter is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.adapter.digest}"


class History(NamedTuple):
    """What a row's penalties and ``min_tokens`` read: every token so far and where the prompt ends."""

    token_ids: list[int]  # prompt + output
    prompt_len: int  # token_ids[prompt_len:] are generated (a decode node's first token included)


class TokenLogprobs(NamedTuple):
    """One sampled token's logprob and the ``k`` most likely tokens' (id, logprob), most likely first."""

    logprob: float
    top: list[tuple[int, float]]


class Sampled(NamedTuple):
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None where not asked for


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, pos: int) -> int:
    """splitmix64 of (seed, position): a well-mixed 63-bit seed per (request seed, token position)."""
    z = (seed * 0x9E3779B97F4A7C15 + pos + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """logits [N, V] + one (params, position of the token to draw, history) per row -> N tokens."""

    def __init__(self, seed: int | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.seed, self.eos_token_ids = seed, tuple(eos_token_ids)
        self.generators: dict[torch.device, torch.Generator] = {}  # unseeded draws: one stream per device

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                 histories: list[History] | None = None) -> list[int]:  # fmt: skip
        return self.sample(logits, params, positions, histories).tokens

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               histories: list[History] | None = None, matchers: list | None = None) -> Sampled:  # fmt: skip
        """``matchers``: per row a grammar matcher (``compute.engine.grammar``) or None; a row's matcher masks its
        logits first and consumes the token drawn."""
        raw = logits.to(torch.float32)  # [N, V]
        x = self._process(raw, params, histories)  # [N, V]: bias, penalties, min_tokens (raw itself if none)
        constrained = [i for i, m in enumerate(matchers or ()) if m is not None]
        if constrained:
            from compute.engine.grammar import mask_logits

            x = x.clone() if x is raw else x  # raw is kept: logprobs read it
            whole = len(constrained) == len(params)  # every row: masked in place, no gather and scatter
            sub, ms = (x if whole else x[constrained]), [matchers[i] for i in constrained]
            mask_logits(sub, ms)
            dead = torch.isneginf(sub.amax(-1)).nonzero().flatten().tolist()
            if dead:  # min_tokens banned the only token the grammar allows (EOS at its end): the grammar wins
                again = raw[[constrained[r] for r in dead]].clone()
                mask_logits(again, [ms[r] for r in dead])
                sub[dead] = again
            if not whole:
                x[constrained] = sub
        tokens = [0] * len(params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            for i, t in zip(greedy, x[greedy].argmax(-1).tolist()):
                tokens[i] = t
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            probs = self._probs(x[drawn], [params[i] for i in drawn])  # [R, V]
            for row, i in zip(probs, drawn):
                g = self._generator(params[i], positions[i], row.device)
                tokens[i] = int(torch.multinomial(row, 1, generator=g))
        for i in constrained:
            matchers[i].consume_token(tokens[i])
        return Sampled(tokens, self._logprobs(raw, params, tokens))

    # -- the steps ---------------------------------------------------------------------------

    def _process(self, raw: torch.Tensor, params: list[SamplingParams], histories: list[History] | None):
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items() if 0 <= t < raw.shape[1]]
        pen = [i for i, p in enumerate(params) if p.penalized] if histories else []
        early = [i for i, p in enumerate(params) if p.min_tokens] if histories else []
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if not (bias or pen or early or allowed):
            return raw
        x = raw.clone()
        for i in allowed:
            keep = torch.tensor([t for t in params[i].allowed_token_ids if t < x.shape[1]], dtype=torch.long,
                                device=x.device)  # fmt: skip
            row = torch.full_like(x[i], float("-inf"))
            row[keep] = x[i, keep]
            x[i] = row
        if bias:
            r, t, b = zip(*bias)
            x.index_put_((torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)),
                         torch.tensor(b, device=x.device), accumulate=True)  # fmt: skip
        if pen:
            x[pen] = _penalize(x[pen], [params[i] for i in pen], [histories[i] for i in pen])
        for i in early:
            h, p = histories[i], params[i]
            if len(h.token_ids) - h.prompt_len < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[1]]
                x[i, banned] = float("-inf")
        return x

    @staticmethod
    def _probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[R, V] processed logits -> [R, V] probabilities after temperature, top-k, top-p and min-p."""
        dev = x.device
        temp = torch.tensor([max(p.temperature, 1e-6) for p in params], device=dev)  # 5e-324 would give inf - inf
        x = x / temp[:, None]
        if not any(0 < p.top_k < x.shape[1] or p.top_p < 1.0 or p.min_p > 0 for p in params):
            return torch.softmax(x, dim=-1)
        vals, order = torch.sort(x, dim=-1, descending=True)  # [R, V]
        k = torch.tensor([p.top_k if 0 < p.top_k < x.shape[1] else x.shape[1] for p in params], device=dev)
        vals = vals.masked_fill(torch.arange(x.shape[1], device=dev)[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]  # mass strictly above each token
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        drop |= probs < min_p[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token is always kept (a top_p of 1e-308 is 0 in float32)
        probs = probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
        return probs / probs.sum(-1, keepdim=True)

    @staticmethod
    def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """row: [V] logits -> [V] probabilities after temperature, top-k, top-p and min-p."""
        return Sampler._probs(row.to(torch.float32)[None], [p])[0]

    @staticmethod
    def _logprobs(raw: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if rows:
            got = token_logprobs(raw[rows], [tokens[i] for i in rows], [params[i].logprobs for i in rows])
            for i, lp in zip(rows, got):
                out[i] = lp
        return out

    def _generator(self, p: SamplingParams, pos: int, device: torch.device) -> torch.Generator:
        if p.seed is not None:  # the same draws wherever it runs on this kind of device
            return torch.Generator(device=device).manual_seed(draw_seed(p.seed, pos))
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device=device)
            if self.seed is not None:
                g.manual_seed(self.seed)
        return g


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """logits [R, V] raw -> per row the logprob of ``tokens[r]`` and the ``ks[r]`` most likely (id, logprob)."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(c, list(zip(ti[:n], tv[:n]))) for c, ti, tv, n in zip(chosen, top_i, top_v, ks)]


def _penalize(x: torch.Tensor, params: list[SamplingParams], hist: list[History]) -> torch.Tensor:
    """x: [R, V] logits of the penalized rows -> penalized (repetition, then frequency and presence)."""
    r, v = x.shape
    dev = x.device

    def counts(seqs: list[list[int]]) -> torch.Tensor:  # [R, V] occurrences; padding goes to column V
        width = max(1, max(len(s) for s in seqs))
        ids = torch.tensor([s + [v] * (width - len(s)) for s in seqs], device=dev)
        return torch.zeros(r, v + 1, device=dev).scatter_add_(1, ids, torch.ones(ids.shape, device=dev))[:, :v]

    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    if bool((rep != 1.0).any()):
        seen = counts([h.token_ids for h in hist]) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    if bool((freq != 0).any() or (pres != 0).any()):
        c = counts([h.token_ids[h.prompt_len :] for h in hist])
        x = x - freq * c - pres * (c > 0)
    return x
