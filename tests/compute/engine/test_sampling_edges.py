"""Sampling at the edges of what the API accepts (found by schemathesis): every valid temperature and
top_p gives a finite distribution that keeps the most likely token."""

from __future__ import annotations

import pytest
import torch

from compute.engine.sampling import Sampler, SamplingParams


@pytest.mark.parametrize("temperature,top_p", [(1.27, 2.2250738585072014e-308), (5e-324, 1.0), (5e-324, 1e-300),
                                               (2.0, 1e-45), (1.0, 1.0)])  # fmt: skip
def test_extreme_valid_params_give_a_finite_distribution(temperature, top_p):
    row = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 20
    probs = Sampler.filtered_probs(row, SamplingParams(temperature=temperature, top_p=top_p))
    assert bool(torch.isfinite(probs).all()) and abs(float(probs.sum()) - 1.0) < 1e-5
    assert float(probs[int(row.argmax())]) > 0
    tok = Sampler(seed=1)(row[None], [SamplingParams(temperature=temperature, top_p=top_p)], [0])
    assert 0 <= tok[0] < 300
