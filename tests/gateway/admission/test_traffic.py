"""The gateway's per-model traffic figures (gateway/admission/traffic.py) on a fake clock: what the autoscaler and
`pdserve status` read (queue waits, TTFT and TPOT over the last minute, arrival rates over 1-2 s)."""

from __future__ import annotations

import pytest

from gateway.admission.traffic import Traffic


def test_traffic_per_model_over_the_last_minute_with_a_fake_clock():
    now = {"m": 100.0, "w": 1000.0}
    tr = Traffic(clock=lambda: now["m"], wall=lambda: now["w"])
    now["w"] += 5
    assert tr.snapshot("a")["idle_s"] == 5.0 and tr.snapshot("a")["last_request_t"] is None
    tr.arrived("a")
    tr.admitting("a", 1)
    assert tr.snapshot("a", held=2)["queue_depth"] == 3
    tr.admitting("a", -1)
    tr.admitted("a", 0.5)
    tr.first_token("a", 0.8)
    s = tr.snapshot("a")
    assert (s["running"], s["requests"], s["idle_s"], s["queue_wait_p99_s"], s["ttft_p99_s"]) == (1, 1, 0.0, 0.5, 0.8)
    now["m"] += 2.0
    tr.finished("a", tokens=11, first_t=100.0, end_t=102.0)  # 10 tokens after the first in 2 s
    now["w"] += 3
    s = tr.snapshot("a")
    assert s["running"] == 0 and s["tpot_p99_s"] == pytest.approx(0.2) and s["idle_s"] == 3.0
    assert tr.snapshot("b")["requests"] == 0
    now["m"] += 61  # the samples leave the window; the counts stay
    s = tr.snapshot("a")
    assert (s["ttft_p99_s"], s["tpot_p99_s"], s["queue_wait_p99_s"], s["requests"]) == (0.0, 0.0, 0.0, 1)



def test_traffic_arrival_rates_rise_within_a_second_and_fall_after_the_window():
    from gateway.admission.traffic import FAST_WINDOW_S, RATE_WINDOW_S

    now = {"m": 100.0}
    tr = Traffic(clock=lambda: now["m"], wall=lambda: now["m"])

    def arrive(rate: float, seconds: float, prompt: int = 40, max_tokens: int = 16) -> None:
        for _ in range(round(rate * seconds)):
            now["m"] += 1.0 / rate
            tr.arrived("a", prompt, max_tokens)

    arrive(2.0, 10.0)  # steady: 2 req/s, nothing finished yet (output = max_tokens)
    s = tr.snapshot("a")
    assert (s["requests_per_s"], s["prompt_tokens_per_s"], s["output_tokens_per_s"]) == (2.0, 80.0, 32.0)
    arrive(8.0, FAST_WINDOW_S)  # a step to 8 req/s: in full after one second
    s = tr.snapshot("a")
    assert s["requests_per_s"] == pytest.approx(8.0) and s["prompt_tokens_per_s"] == pytest.approx(320.0)
    # requests stop at EOS well before max_tokens: the expected output is their mean, not the cap
    for _ in range(4):
        tr.admitted("a", 0.0)
        tr.finished("a", tokens=4, first_t=now["m"] - 1, end_t=now["m"])
    assert tr.snapshot("a")["output_tokens_per_s"] == pytest.approx(8.0 * 4)
    now["m"] += FAST_WINDOW_S  # a quiet second: the whole window still counts the step
    assert tr.snapshot("a")["requests_per_s"] == pytest.approx(8 / RATE_WINDOW_S)
    now["m"] += RATE_WINDOW_S  # the window passed: no demand
    s = tr.snapshot("a")
    assert (s["requests_per_s"], s["prompt_tokens_per_s"], s["output_tokens_per_s"]) == (0.0, 0.0, 0.0)
