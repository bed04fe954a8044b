"""The native int8 kernel (compute/kernels/native): exact fp32 sums on every body this CPU has, odd shapes,
unaligned inputs, bitwise the same row alone and in any batch, clear errors, and the library built at install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from compute.kernels import int8, native, plans

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.why_unavailable()}")


def _weights(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * 0.05
    scale = w.abs().amax(1).clamp_min(1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("n,k", [(576, 576), (37, 100), (1, 7), (64, 1536), (19, 16), (130, 33)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 40])
def test_native_equals_the_fp64_reference(isa, n, k, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    q, scale = _weights(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    y = native.int8_linear(x, q, scale)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-5  # fp32 sums: no activation rounding


def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(isa):
    gen = torch.Generator().manual_seed(1)
    q, scale = _weights(200, 584, gen)  # K = 584: a vector tail on both bodies
    x = torch.randn(70, 584, generator=gen)
    big = native.int8_linear(x, q, scale)
    for m in (1, 2, 3, 4, 5, 8, 15, 16, 17, 33, 69):
        assert torch.equal(native.int8_linear(x[:m], q, scale), big[:m]), m
    for i in (0, 5, 69):
        assert torch.equal(native.int8_linear(x[i : i + 1], q, scale)[0], big[i])
    assert int8.row_invariant("native", q, scale, scale.bfloat16(), None, gen)  # the table's own probe agrees


def test_unaligned_and_bf16_inputs(isa):
    gen = torch.Generator().manual_seed(2)
    q, scale = _weights(48, 96, gen)
    raw = torch.randn(5 * 96 + 3, generator=gen)
    x = raw[3:].view(5, 96)  # 12 bytes past the allocation: unaligned
    buf = torch.empty(48 * 96 + 1, dtype=torch.int8)
    qu = buf[1:].view(48, 96)
    qu.copy_(q)
    assert x.data_ptr() % 64 and qu.data_ptr() % 2
    assert torch.equal(native.int8_linear(x, qu, scale), native.int8_linear(x.clone(), q, scale))
    xb = x.bfloat16()
    assert torch.equal(native.int8_linear(xb, q, scale), native.int8_linear(xb.float(), q, scale))


def test_bad_shapes_raise_a_clear_error():
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="K differs"):
        native.int8_linear(torch.zeros(2, 15), q, torch.ones(8))
    with pytest.raises(RuntimeError, match="one scale per output row"):
        native.int8_linear(torch.zeros(2, 16), q, torch.ones(7))
    with pytest.raises(RuntimeError, match="contiguous int8"):
        native.int8_linear(torch.zeros(2, 16), q.float(), torch.ones(8))
    assert native.int8_linear(torch.zeros(0, 16), q, torch.ones(8)).shape == (0, 8)


def test_the_rule_runs_native_for_decode_and_the_table_measures_it():
    shapes = [(64, 128)]
    rule = plans.rule_table(shapes, torch.get_num_threads())["shapes"]["64x128"]
    assert rule["choice"][:3] == ["native"] * 3 and rule["choice"][3] == "dequant" and rule["invariant"] == "native"
    table = int8.measure(shapes, torch.get_num_threads(), repeats=1)["shapes"]["64x128"]
    assert table["error"]["native"] < 1e-5 and table["row_invariant"]["native"] is True
    assert set(table["row_invariant"]) <= set(int8.INVARIANT_BY_CONSTRUCTION)  # only those are probed


def test_the_build_is_atomic_and_a_process_without_it_runs_the_rest(tmp_path):
    """``python -m compute.kernels.native`` finds the library built (nothing to do); PDSERVE_NATIVE=0 leaves the
    kernel out of the table and the rule falls back to int8mm."""
    done = subprocess.run([sys.executable, "-m", "compute.kernels.native"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0 and native.library_path() in done.stdout
    assert not [f for f in os.listdir(native.BUILD_DIR) if f.endswith(".tmp")]
    code = ("import torch; from compute.kernels import int8, plans; "
            "print(int8.usable('native', 8, 16), plans.rule_table([(8, 16)], 1)['shapes']['8x16']['choice'][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PDSERVE_NATIVE": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "int8mm"]


def test_candidates_follow_the_cpu_and_a_shape_stops_at_its_budget(monkeypatch):
    assert int8.candidates(flags="avx2 fma") == ["int8mm", "dequant", "native"]
    assert int8.candidates(flags="avx2 fma avx_vnni") == ["int8mm", "dequant", "w8a8", "w8a16", "native"]
    assert set(int8.candidates(flags="avx512f avx512_bf16 avx512_vnni")) == set(int8.KERNELS)
    runs = []
    real_run = int8.run

    def counted(name, *a):
        runs.append(name)
        return real_run(name, *a)

    monkeypatch.setattr(int8, "run", counted)
    int8.measure([(64, 128)], 1, repeats=50, kernels=("dequant", "native"), budget_s=0.0)
    timing = len([r for r in runs if r == "dequant"])  # error check 1 + warm-up 2 per M, no repeat
    assert timing == 1 + 2 * len(int8.PROBE_M)
