"""compute/kernels/int8.py: every candidate's numbers, the measured choice, its cache, and a model running it.

Timings are whatever this CPU gives; the tests assert what holds on any x86 CPU: each usable
kernel agrees with the fp32 reference within the gate, the choice per bucket is the fastest of
the recorded times among kernels within the gate, the cached table is reused (and re-measured
for another machine key), and a tiny int8 model gives the same greedy tokens on every plan.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from compute.kernels import int8, native
from compute.kernels.table_text import format_table
from tests.compute.kernels.cpu import int_mm_is_exact
from tests.compute.tiny import dequantized, int8_tiny_seed3, logits, quantize

SHAPES = [(96, 64), (48, 128)]


@pytest.mark.parametrize("m, want", [(1, 0), (2, 1), (8, 1), (9, 2), (64, 2), (65, 3), (4096, 3)])
def test_buckets(m, want):
    assert int8.bucket(m) == want


@pytest.mark.parametrize("name", int8.KERNELS)
@pytest.mark.parametrize("m", [1, 5, 33, 130])
def test_each_kernel_agrees_with_the_fp32_reference(name, m):
    if name == "native":  # loaded as a node loads it (the session built it: tests/conftest.py)
        assert native.available(), native.why_unavailable()
    q, s = quantize(torch.randn(96, 64))
    x = torch.randn(m, 64)
    ref = F.linear(x.double(), (q.double() * s.double()[:, None]))
    y = int8.run(name, x, q, s, s.to(torch.bfloat16), int8.bf16_weight(q, s)).double()
    assert y.shape == (m, 96)
    rel = float((y - ref).norm() / ref.norm())
    if name in ("w8a8", "w8a16") and not int_mm_is_exact():  # saturating int8 GEMM (no VNNI): w8a8 6-9%,
        # w8a16 5-8% on these inputs; on the table's own probe (outlier activations) the gate keeps both out
        xe = int8._outlier_input(16, 64, torch.Generator().manual_seed(0))
        want = F.linear(xe.double(), (q.double() * s.double()[:, None]))
        got = int8.run(name, xe, q, s, s.to(torch.bfloat16), int8.bf16_weight(q, s)).double()
        assert float((got - want).norm() / want.norm()) > int8.ERROR_GATE, name
        return
    assert rel < (1e-6 if name == "dequant" else 0.03), (name, rel)  # bf16 / int8 activations: ~0.3% / ~1%


def test_the_bf16_copy_is_converted_in_blocks_bitwise_as_one_expression(monkeypatch):
    monkeypatch.setattr(int8, "BF16_BLOCK_ELEMS", 3 * 40)  # 3 rows per block: 101 rows end in a partial one
    q = torch.randint(-127, 128, (101, 40), dtype=torch.int8)
    scale = torch.rand(101) * 0.01
    got = int8.bf16_weight(q, scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (q.to(torch.float32) * scale[:, None]).to(torch.bfloat16))


def test_measure_chooses_the_fastest_within_the_gate_and_keeps_w8a8_out_on_outlier_activations():
    table = int8.measure(SHAPES, torch.get_num_threads(), repeats=2)
    assert table["key"] == int8.machine_key(torch.get_num_threads())
    for n, k in SHAPES:
        e = table["shapes"][f"{n}x{k}"]
        assert e["error"]["dequant"] < 1e-5
        if "w8a8" in int8.candidates():  # measured only where the CPU has VNNI / AMX-int8
            assert e["error"]["w8a8"] > int8.ERROR_GATE  # outliers: per-row int8 fails
        for m, choice in zip(int8.PROBE_M, e["choice"]):
            times = e["us"][str(m)]
            assert "w8a8" not in times and choice == min(times, key=times.get)
    assert "quant" not in format_table(table).split("\n")[0] and "M=256" in format_table(table)


def test_plan_is_cached_per_machine_key_and_extended_for_new_shapes(tmp_path):
    path = str(tmp_path / "k" / "int8.json")
    first = int8.plan_for(SHAPES[:1], 1, path)
    assert first["cached"] is False and set(first["shapes"]) == {"96x64"}
    again = int8.plan_for(SHAPES[:1], 1, path)
    assert again["cached"] is True and again["shapes"] == first["shapes"]
    more = int8.plan_for(SHAPES, 1, path)  # one new shape: measured and added, the old kept as it was
    assert more["cached"] is False and more["shapes"]["96x64"] == first["shapes"]["96x64"]
    two = int8.plan_for(SHAPES, 2, path)  # another thread count: a table of its own, beside the first
    assert two["cached"] is False and int8.plan_for(SHAPES, 1, path)["cached"] is True
    with open(path) as f:
        on_disk = json.load(f)
    assert set(on_disk["tables"]) == {int8.machine_key(1), int8.machine_key(2)}
    on_disk["tables"] = {"another machine": on_disk["tables"][int8.machine_key(1)]}
    with open(path, "w") as f:
        json.dump(on_disk, f)
    assert int8.plan_for(SHAPES, 1, path)["cached"] is False  # not this machine's table: measured again
    assert not [p for p in (tmp_path / "k").iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("plan", [("int8mm",) * 4, ("bf16",) * 4, ("dequant",) * 4, ("int8mm", "bf16", "bf16", "bf16")])
def test_a_model_runs_any_plan_within_bf16_rounding_of_the_fixed_rule(plan):
    model = int8_tiny_seed3()
    mods = model.kernel_modules()
    assert mods and all(x.plan is None for x in mods)
    one, many = [[5, 9, 33, 7]], [[5, 9, 33, 7], list(range(40, 80)), list(range(100, 130))]  # M = 4 | 74
    ref = dequantized(model)
    fixed = [logits(model, ps) for ps in (one, many)]
    model.use_kernels({"shapes": {f"{n}x{k}": {"choice": list(plan)} for n, k in model.int8_shapes()}})
    assert all(x.plan == plan for x in mods)
    assert all((x.w_bf16 is not None) == ("bf16" in plan) for x in mods)  # the copy only where a bucket runs it
    for ps, f in zip((one, many), fixed):
        got, want = logits(model, ps), logits(ref, ps)
        assert float((got - want).norm() / want.norm()) < 0.02  # bf16 rounding of activations / weights
        assert float((f - want).norm() / want.norm()) < 0.02
    model.use_kernels(None)
    assert all(x.plan is None and x.w_bf16 is None for x in mods)
    assert torch.equal(logits(model, many), fixed[1])  # back on the fixed rule


def test_a_plan_naming_an_unknown_kernel_is_refused():
    model = int8_tiny_seed3()
    with pytest.raises(ValueError, match="one of"):
        model.kernel_modules()[0].use_kernels(("int8mm", "magic", "bf16", "bf16"))


def test_an_unwritable_cache_costs_a_measurement_never_the_load(tmp_path, tiny_hf):
    """Ready at once on the rule; the background measurement runs without a cache; its plan is swapped in only
    through an attached engine's thread."""
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store = ParamStore(StoreConfig.local_default(str(tmp_path / "store"), k=2, m=1))
    try:
        store.import_model(tiny_hf[0], "tiny", dtype="int8")
        inj = WeightInjector(store, "tiny", "int8", kernel_cache=str(blocked / "int8.json")).start()
        assert inj.wait(60) and inj.kernel_source == "rule" and inj.kernel_table.get("rule")
        assert inj.planner.wait(120) and inj.planner.state == "done"  # measured without a cache
        assert inj.kernel_source == "rule"  # no engine attached: an in-process model keeps the plan it started with
        posted = []
        inj.attach(post=posted.append, served=lambda: False, busy=lambda: False)  # a node's engine, built later
        assert len(posted) == 1 and inj.kernel_source == "rule"  # the pending plan, posted to its engine thread
        posted[0]()
        assert inj.kernel_source == "measured" and not inj.kernel_table.get("rule")
        blocking = WeightInjector(store, "tiny", "int8", kernel_cache=str(blocked / "int8.json"), measure="blocking")
        assert blocking.start().wait(120) and blocking.kernel_source == "measured" and blocking.planner is None
        fixed = WeightInjector(store, "tiny", "int8", kernels="fixed").start()
        assert fixed.wait(60) and fixed.kernel_table is None
        assert all(m.plan is None for m in fixed.model.kernel_modules())
        assert all(m.plan is not None for m in inj.model.kernel_modules())
    finally:
        store.close()


def test_invariant_keeps_its_plan_once_it_has_served(tmp_path, tiny_hf):
    """kernels = invariant: a measured plan is swapped in before the first request, never after one."""
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig

    with ParamStore(StoreConfig.local_default(str(tmp_path / "store"), k=2, m=1)) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="int8")
        for served in (True, False):
            for row in store.plans.list():  # the first round published its plan: measure again
                store.plans.delete(row["id"])
            inj = WeightInjector(store, "tiny", "int8", kernels="invariant", kernel_cache=None).start()
            assert inj.wait(60) and inj.kernel_source == "rule"
            assert all(m.plan == ("native",) * 4 for m in inj.model.kernel_modules())  # the rule's invariant kernel
            posted = []
            inj.attach(post=posted.append, served=lambda s=served: s, busy=lambda: False)
            assert inj.planner.wait(120) and inj.planner.state == "done" and len(posted) == 1
            posted[0]()
            assert inj.kernel_source == ("rule" if served else "measured"), served
