"""What this hardware carries for one model, measured online from the engine's own steps.

The engine thread ``record``s every step: how many sequences decoded in it, how many prompt
tokens it prefilled, and how long it took. From a window of recent steps:

- pure-decode steps (no prefill tokens) give the step time as a line in the batch size,
  ``step_s = a + b * batch`` (least squares; needs two distinct batch sizes); ``max_streams`` is
  the batch at which that line passes ``tpot_target_s`` (each stream gets one token per step, so
  the step time *is* its TPOT), capped at the engine's ``max_num_seqs``;
- ``decode_tokens_per_s``: tokens decoded / time of those steps;
- ``prefill_tokens_per_s``: prompt tokens / (time of the steps that carried them, less their
  decoders' share by the fitted line when there is one).

Nothing here is a constant fitted to a machine: every figure is null until measured.
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW = 512  # steps kept
_REFIT_S = 1.0  # report() refits at most this often


class CapacityMeter:
    def __init__(self, tpot_target_s: float, max_streams: int, window: int = WINDOW):
        self.tpot_target_s, self.max_num_seqs = tpot_target_s, max_streams
        self._decode: deque[tuple[int, float]] = deque(maxlen=window)  # (batch, step seconds)
        self._mixed: deque[tuple[int, int, float]] = deque(maxlen=window)  # (decodes, prompt tokens, seconds)
        self._lock = threading.Lock()
        self._cached: tuple[float, dict] | None = None
        self.samples = 0

    def record(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """One engine step (engine thread)."""
        if decodes <= 0 and prefill_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            if prefill_tokens:
                self._mixed.append((decodes, prefill_tokens, seconds))
            else:
                self._decode.append((decodes, seconds))
            self.samples += 1

    def report(self) -> dict:
        """The capacity dict of ``/load`` (contract A); refitted at most once a second."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < _REFIT_S:
            return self._cached[1]
        with self._lock:
            dec, mixed, n = list(self._decode), list(self._mixed), self.samples
        line = fit_line(dec)
        out = {"tpot_target_s": self.tpot_target_s, "decode_step_s": None, "max_streams": None,
               "decode_tokens_per_s": None, "prefill_tokens_per_s": None, "samples": n}  # fmt: skip
        if dec:
            out["decode_tokens_per_s"] = sum(b for b, _ in dec) / sum(t for _, t in dec)
        if line is not None:
            a, b = line
            out["decode_step_s"] = {"a": a, "b": b}
            out["max_streams"] = streams_at(a, b, self.tpot_target_s, self.max_num_seqs)
        if mixed:
            spent = sum(max(t - (a + b * d if line and d else 0.0), 0.1 * t) for d, _, t in mixed)
            out["prefill_tokens_per_s"] = sum(p for _, p, _ in mixed) / spent
        self._cached = (now, out)
        return out


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``(a, b)`` of ``seconds = a + b * batch``; None without two distinct batch sizes."""
    if len({b for b, _ in samples}) < 2:
        return None
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(t for _, t in samples) / n
    sxx = sum((b - mx) ** 2 for b, _ in samples)
    sxy = sum((b - mx) * (t - my) for b, t in samples)
    slope = sxy / sxx
    return my - slope * mx, slope


def streams_at(a: float, b: float, target_s: float, cap: int) -> int:
    """The largest batch whose fitted step time stays within ``target_s`` (at least 1, at most ``cap``).

    A step of one stream already past the target: 1 (no batch meets it, whatever the slope's sign —
    on a fast CPU the fitted slope over batches 1-3 can come out flat or negative from noise alone).
    """
    if a + b > target_s:
        return 1
    if b <= 0:
        return cap  # within the target at batch 1 and not growing with the batch over what was seen
    return int(max(1, min(cap, (target_s - a) // b)))
