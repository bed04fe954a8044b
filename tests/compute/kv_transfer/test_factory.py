"""The factory: roles, lazy imports, options routed to backends."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from compute.kv_transfer import KVPool, make_transfer


def test_roles_and_options(layout):
    pool = KVPool.allocate(layout, 4)
    with make_transfer("fake", "prefill", layout, pool) as s:
        assert s.backend == "fake"
    r = make_transfer("fake", "decode", layout, pool.tensor, fail_rate=1.0)  # a bare tensor is wrapped
    assert r.fail_rate == 1.0
    with pytest.raises(ValueError):
        make_transfer("fake", "both", layout, pool)
    with pytest.raises(TypeError):
        make_transfer("tcp", "decode", layout, pool, fail_rate=1.0)  # not a tcp option
    with pytest.raises(ValueError):
        make_transfer("fake", "decode", layout, torch.zeros(layout.shape(4), dtype=torch.bfloat16))


def test_backends_are_imported_only_when_used():
    code = (
        "import sys, torch\n"
        "from compute.kv_transfer import KVLayout, KVPool, make_transfer\n"
        "lay = KVLayout(1, 4, 1, 4)\n"
        "make_transfer('tcp', 'decode', lay, KVPool.allocate(lay, 2)).close()\n"
        "bad = [m for m in ('nixl_cu12', 'compute.kv_transfer.nixl', 'compute.kv_transfer.fake') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
