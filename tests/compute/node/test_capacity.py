"""compute/node/capacity.py: the step-time line and the batch it allows, pure (no engine)."""

from __future__ import annotations

import pytest

from compute.node.capacity import CapacityMeter, fit_line, streams_at


def test_fit_line_recovers_a_line_and_needs_two_batch_sizes():
    a, b = fit_line([(1, 0.012), (2, 0.014), (4, 0.018), (8, 0.026)])
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    assert fit_line([(3, 0.01), (3, 0.02)]) is None


@pytest.mark.parametrize("a, b, target, cap, want", [
    (0.010, 0.002, 0.100, 64, 45),  # (0.1 - 0.01) / 0.002
    (0.010, 0.002, 0.100, 16, 16),  # capped
    (0.010, 0.002, 0.001, 64, 1),  # not even one stream meets it
    (0.020, -0.0005, 0.001, 64, 1),  # noise made the slope negative; the step is still past the target: 1, not cap
    (0.020, 0.0, 0.001, 64, 1),
    (0.020, -0.0005, 0.100, 64, 64),  # within the target and flat: the cap
])  # fmt: skip
def test_streams_at(a, b, target, cap, want):
    assert streams_at(a, b, target, cap) == want


def test_meter_reports_one_stream_when_no_batch_meets_the_target_even_with_a_flat_line():
    m = CapacityMeter(tpot_target_s=0.001, max_streams=32)
    for batch, s in [(1, 0.020), (2, 0.019), (3, 0.0195), (1, 0.0205), (3, 0.019)]:  # flat within noise
        m.record(batch, 0, s)
    m.record(0, 100, 0.05)
    rep = m.report()
    assert rep["max_streams"] == 1 and rep["samples"] == 6
    assert rep["decode_tokens_per_s"] == pytest.approx(10 / 0.098)
    assert rep["prefill_tokens_per_s"] == pytest.approx(100 / 0.05)
