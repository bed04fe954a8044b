"""The native library's ISA levels as a fixture: each test of a native kernel runs on every body this CPU has."""

from __future__ import annotations

import pytest
import torch

from compute.kernels import native

LEVELS = [lv for lv in (0, 1, 2) if lv <= native.ISA_LEVELS.get(torch.backends.cpu.get_cpu_capability().lower(), 0)]


@pytest.fixture(params=LEVELS, ids=lambda lv: ("scalar", "avx2", "avx512")[lv])
def isa(request):
    """The level set for the test (scalar | avx2 | avx512 bodies), restored after it."""
    if not native.available():
        pytest.skip(f"native kernels not built: {native.why_unavailable()}")
    was = int(torch.ops.pdserve.int8_isa(-1))
    got = int(torch.ops.pdserve.int8_isa(request.param))
    yield got
    torch.ops.pdserve.int8_isa(was)
