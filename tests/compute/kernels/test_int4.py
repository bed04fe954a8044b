"""INT4 weights on the CPU int4 kernel: the repack's convention, linears and fused parts against a dequantized
fp32 reference, clear errors, and a model injected from an int4 import end to end."""

from __future__ import annotations

import pytest
import torch

from compute.errors import WeightMismatch
from compute.kernels import int4
from compute.kernels.linear import Embedding, FusedLinear, Linear
from paramstore.quant4 import dequantize_int4, quantize_int4
from tests.compute.tiny import int4_tiny

pytestmark = pytest.mark.skipif(not int4.kernel_available(), reason="this torch has no CPU int4 kernel")


def _weight(n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    packed, scale, zero = quantize_int4(w)
    return {"weight": packed, "weight_scale": scale, "weight_zero": zero}, dequantize_int4(packed, scale, zero)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_repack_keeps_the_stores_convention():
    stored, ref = _weight(96, 128)
    w, sz = int4.repack(stored["weight"], stored["weight_scale"], stored["weight_zero"])
    assert w.dtype == torch.uint8 and w.shape == (96, 64) and sz.shape == (4, 96, 2) and sz.dtype == torch.bfloat16
    # the kernel's own dequantization (x = identity) equals the store's, up to bf16 rounding of each value
    assert torch.allclose(int4.dequantized(w, sz), ref, rtol=2**-7, atol=1e-6)
    scale, zero = int4.scale_zero_views(sz, slice(10, 20))
    assert torch.equal(scale, stored["weight_scale"][10:20]) and torch.equal(zero, stored["weight_zero"][10:20])


@pytest.mark.parametrize("m", [1, 3, 8, 64, 200])
def test_int4_linear_matches_the_dequantized_fp32_reference(m):
    stored, ref = _weight(160, 96, seed=m)
    lin = Linear(96, 160, bias=True)
    bias = torch.randn(160)
    for leaf, t in [*stored.items(), ("bias", bias)]:
        lin.load(leaf, t)
    assert lin.missing() == [] and lin.is_int4 and lin.int8_weight() is None
    x = torch.randn(m, 96)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, 160)
    assert _rel(y, x @ ref.t() + bias) < 0.01  # bf16 activations: ~0.3%


def test_fused_int4_parts_any_order_equal_separate_and_keep_no_stored_copy():
    parts = [_weight(n, 64, seed=i) for i, n in enumerate((64, 32, 32))]
    fused = FusedLinear(64, (64, 32, 32))
    order = [(p, leaf) for p in (2, 0, 1) for leaf in ("weight_zero", "weight", "weight_scale")]
    for i, (p, leaf) in enumerate(order):
        assert fused.sz is None
        fused.parts[p].load(leaf, parts[p][0][leaf])
        assert fused.parts[p].missing() == [] or i % 3 != 2 or p != order[i][0]
    assert fused.sz is not None and all(part.missing() == [] for part in fused.parts)
    assert fused.int8_weight() is None and not fused.groups
    w_ptr = fused.w.untyped_storage().data_ptr()
    assert all(part.weight.untyped_storage().data_ptr() == w_ptr for part in fused.parts)  # views, no copies
    x = torch.randn(5, 64)
    ref = torch.cat([x @ r.t() for _, r in parts], 1)
    assert _rel(fused(x), ref) < 0.01 and fused(x).dtype == torch.float32
    assert fused(x, cast=False).dtype == torch.bfloat16  # the kernel's output as is, for a caller that promotes
    assert torch.equal(fused.parts[1].weight_scale, parts[1][0]["weight_scale"])


def test_int4_bad_input_fails_clearly():
    stored, _ = _weight(64, 64)
    with pytest.raises(WeightMismatch, match="int4"):
        Embedding(64, 64).load("weight", stored["weight"])
    with pytest.raises(WeightMismatch, match="K % 32"):
        Linear(48, 64).load("weight", torch.zeros(64, 24, dtype=torch.uint8))
    with pytest.raises(WeightMismatch, match="shape"):
        Linear(64, 64).load("weight", torch.zeros(64, 64, dtype=torch.uint8))
    with pytest.raises(WeightMismatch, match="shape"):
        Linear(64, 64).load("weight_zero", torch.zeros(64, 3, dtype=torch.bfloat16))
    fused = FusedLinear(64, (64, 64))
    fused.parts[0].load("weight", stored["weight"])
    with pytest.raises(WeightMismatch, match="dtype"):
        fused.parts[1].load("weight", torch.zeros(64, 64, dtype=torch.int8))


def test_model_from_an_int4_import_end_to_end(memory_store_config, tiny_hf):
    """The node's path: import --dtype int4, inject (int4 linears on the kernel, int8 embedding and head on the
    int8 plan), greedy decode; against the same import dequantized to an fp32 runtime."""
    from benchmarks.step_profile import weight_bytes
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore

    with ParamStore(memory_store_config) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="int4")
        store.import_model(tiny_hf[0], "tiny8", dtype="int8")
        q4, f32, q8 = (WeightInjector(store, ref, weights=w, kernels="fixed", text=False).start()
                       for ref, w in (("tiny", "int8"), ("tiny", "fp32"), ("tiny8", "int8")))  # fmt: skip
        assert q4.wait(30) and f32.wait(30) and q8.wait(30)
    layer = q4.model.model.layers[0]
    assert layer.mlp.down_proj.is_int4 and layer.self_attn.qkv.sz is not None
    assert [tuple(m.int8_weight()[0].shape) for m in q4.model.kernel_modules()] == [(256, 64)]  # the head alone
    b4, b8 = weight_bytes(q4.model), weight_bytes(q8.model)
    layer_bytes = sum(t.numel() for n, t in tiny_hf[2].items() if ".layers." in n and t.dim() == 2)
    assert b4["int4"] == layer_bytes // 2 and b8["int4"] == 0 and b4["bf16 copies"] == 0
    # the scale/zero tables once (4 bytes per 32 weights), no stored copies left beside the repacked weights
    assert b4["other"] - b8["other"] <= layer_bytes // 8, (b4, b8)
    prompts = [[5, 17, 33, 2], [9, 9, 100, 41, 7, 250]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [Engine.for_model(i.model, num_blocks=16).generate(prompts, params) for i in (q4, f32)]
    assert all(len(o) == 8 for o in outs[0])
    # the int4 kernel (bf16 activations) against the same int4 values in fp32: the first tokens agree
    assert [o[:2] for o in outs[0]] == [o[:2] for o in outs[1]], outs


def test_int4_bf16_copies_only_within_a_budget_and_agree_with_int4mm():
    model = int4_tiny()
    mods = model.int4_modules()
    sizes = [2 * m.int4_weight()[0].shape[0] * m.int4_weight()[1].shape[0] * int4.GROUP for m in mods]
    x = torch.randn(3 * int4.COPY_MIN_M, mods[0].in_features)
    before = mods[0](x)
    assert model.use_int4_copies(None, faster=lambda n, k: True) == 0  # no budget: none, the int4 size
    assert model.use_int4_copies(10**9, "invariant", faster=lambda n, k: True) == 0
    assert model.use_int4_copies(10**9, faster=lambda n, k: False) == 0  # where int4mm measures faster: none
    budget = sizes[0] + sizes[1] + 1
    assert model.use_int4_copies(budget, faster=lambda n, k: True) == sizes[0] + sizes[1]
    assert [m.w_bf16 is not None for m in mods[:3]] == [True, True, False]
    after = mods[0](x)
    assert _rel(after, before) < 0.01  # the copy's bf16 GEMM vs int4mm on the same int4 values
    small = x[: int4.COPY_MIN_M]
    assert torch.equal(mods[0](small), before[: int4.COPY_MIN_M])  # at M <= COPY_MIN_M: int4mm still
    assert model.use_int4_copies(0, faster=lambda n, k: True) == 0 and all(m.w_bf16 is None for m in mods)


_LEVEL_CHECK = """
import torch
from paramstore.quant4 import quantize_int4, dequantize_int4
from compute.kernels import int4
w = torch.randn(576, 576, generator=torch.Generator().manual_seed(0)) * 0.05
p, s, z = quantize_int4(w)
ref = dequantize_int4(p, s, z)
W, SZ = int4.repack(p, s, z)
worst = 0.0
for off in (0, 1, 3, 8):  # inputs at 2-, 6- and 16-byte offsets too (int8mm needs 32-byte aligned inputs)
    for m in (1, 2, 4, 7, 16, 33, 64):
        x = torch.randn(m * 576 + off).to(torch.bfloat16)[off:].view(m, 576)
        r = x.float() @ ref.t()
        worst = max(worst, ((int4.matmul(x, W, SZ).float() - r).norm() / r.norm()).item())
print(torch.backends.cpu.get_cpu_capability(), worst)
"""


def test_int4_kernel_under_every_dispatch_level_and_unaligned_inputs():
    """Each ATEN_CPU_CAPABILITY this CPU has, in a subprocess (a segfault fails the test, not the session)."""
    import os
    import subprocess
    import sys

    from tests.compute.kernels.cpu import LEVELS, missing_reason

    ran = []
    for level in (lv for lv in LEVELS if missing_reason(lv) is None):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-c", _LEVEL_CHECK], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, (level, p.returncode, p.stderr[-2000:])
        got, err = p.stdout.split()
        assert got.lower() == level and float(err) < 0.005, (level, p.stdout)  # bf16 rounding: ~0.2%
        ran.append(level)
    assert "default" in ran


def test_int4mm_rows_do_not_depend_on_the_batch():
    """Every row of int4mm's output is bitwise the same at every M of the int8 table's invariance probe as alone:
    int4 linears keep ``kernels = invariant`` batch-invariant (they keep no bf16 copy there)."""
    from compute.kernels.int8 import INVARIANCE_M

    stored, _ = _weight(576, 576)
    w, sz = int4.repack(stored["weight"], stored["weight_scale"], stored["weight_zero"])
    x = torch.randn(max(INVARIANCE_M), 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    big = int4.matmul(x, w, sz)
    assert all(torch.equal(int4.matmul(x[i : i + 1], w, sz)[0], big[i]) for i in range(8))
    assert [m for m in INVARIANCE_M if not torch.equal(int4.matmul(x[:m], w, sz), big[:m])] == []
