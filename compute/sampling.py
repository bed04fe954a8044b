"""Sampling parameters of a request and the sampler that turns logits into tokens.

Temperature 0 is greedy (argmax). Otherwise logits are divided by the
temperature, filtered by top-k then top-p (nucleus), and one token is drawn per
row. A request with a ``seed`` draws the token at absolute position ``pos`` (prompt
tokens count) from a generator seeded with ``draw_seed(seed, pos)``: its tokens do
not depend on what else is in the batch, and they do not depend on *where* they
are drawn either — the prefill node's first token, the decode node's rest, and a
re-prefill after failover (prompt + replayed tokens) all draw at the same
positions, so a seeded request gives the same text split or colocated. Requests
without a seed share the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    """What a request asks of generation."""

    max_tokens: int = 16  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request reproducible sampling
    stop_token_ids: tuple[int, ...] = ()  # finish when one is generated (kept in the output)
    ignore_eos: bool = False  # do not finish on the model's EOS ids

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0



_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, pos: int) -> int:
    """splitmix64 of (seed, position): a well-mixed 63-bit seed per (request seed, token position)."""
    z = (seed * 0x9E3779B97F4A7C15 + pos + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """logits [N, V] + one (params, position of the token to draw) per row -> N token ids."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}  # unseeded draws: one stream per device

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        out = []
        for row, p, pos in zip(logits.to(torch.float32), params, positions):
            out.append(int(row.argmax()) if p.greedy else self._draw(row, p, self._generator(p, pos, row.device)))
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

    @staticmethod
    def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """row: [V] logits -> [V] probabilities after temperature, top-k and top-p."""
        row = row / max(p.temperature, 1e-6)  # a vanishing temperature (5e-324) would make inf - inf = nan
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
            drop = before >= p.top_p
            drop[0] = False  # the most likely token is always kept (a top_p of 1e-308 is 0 in float32)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()

    def _draw(self, row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
        return int(torch.multinomial(self.filtered_probs(row, p), 1, generator=g))
