"""Sampling parameters of a request and the sampler that turns logits into tokens.

Temperature 0 is greedy (argmax). Otherwise logits are divided by the
temperature, filtered by top-k then top-p (nucleus), and one token is drawn per
row. A request with a ``seed`` draws from its own ``torch.Generator``, so its
tokens do not depend on what else is in the batch; requests without one share
the sampler's generator.
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

    def make_generator(self) -> torch.Generator | None:
        """A fresh generator for this request, or None when it has no seed."""
        if self.seed is None:
            return None
        return torch.Generator(device="cpu").manual_seed(self.seed)


class Sampler:
    """logits [N, V] + one (params, generator) per row -> N token ids."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator(device="cpu")
        if seed is not None:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        out = []
        for row, p, g in zip(logits.to(torch.float32), params, generators):
            out.append(int(row.argmax()) if p.greedy else self._draw(row, p, g or self.generator))
        return out

    @staticmethod
    def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """row: [V] logits -> [V] probabilities after temperature, top-k and top-p."""
        row = row / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
            drop = before >= p.top_p  # the most likely token is always kept
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()

    def _draw(self, row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
        return int(torch.multinomial(self.filtered_probs(row, p), 1, generator=g))
