"""compute/kernels/budget.py: bf16 weight copies kept within a node's ``weight_copies_gb``, most time saved per byte
first; the other linears run the fastest kernel that needs no copy; the runtime weight bytes of a tiny int8 model
stay within the budget + its int8 size, and its logits within bf16 rounding of the unbudgeted plan. (The setting
itself: tests/compute/node/test_weight_copies.py.)

Tables here are written by hand (timings chosen so that each shape's copy is worth a known amount): a measured
table's choice depends on the CPU, and the budget's arithmetic must not."""

from __future__ import annotations

import pytest
import torch

from compute.kernels import budget, int8
from compute.node.held import tensor_bytes
from tests.compute.kernels.cpu import int_mm_is_exact
from tests.compute.tiny import dequantized, int8_tiny_seed3, logits

PLAN = ["int8mm", "bf16", "bf16", "w8a16"]  # a measured plan as on the avx512_bf16 box: the copy at M = 8 and 32


def entry(saves: float, invariant: str | None = "int8mm") -> dict:
    """A table entry whose bf16 copy saves ``saves`` us at M = 8 and at M = 32 over the best no-copy kernel."""
    us = {"1": {"int8mm": 10.0, "bf16": 40.0, "w8a16": 50.0, "dequant": 90.0},
          "8": {"int8mm": 50.0 + saves, "bf16": 50.0, "w8a16": 60.0 + saves, "dequant": 300.0},
          "32": {"int8mm": 200.0, "bf16": 100.0, "w8a16": 100.0 + saves, "dequant": 400.0},
          "256": {"int8mm": 1600.0, "bf16": 900.0, "w8a16": 800.0, "dequant": 1000.0}}  # fmt: skip
    return {"choice": list(PLAN), "us": us, "error": {}, "invariant": invariant,
            "row_invariant": {"int8mm": True, "w8a16": True, "bf16": False, "dequant": False}}  # fmt: skip


def test_no_copy_runs_the_fastest_kernel_without_one_per_bucket():
    e = entry(saves=30.0)
    assert budget.no_copy(e, "measured") == ("int8mm", "int8mm", "w8a16", "w8a16")  # 80 vs 90 at M = 8, 200 vs 130 at 32
    assert budget.saved_us(e, "measured") == pytest.approx(30.0 + 30.0)
    inv = entry(saves=30.0, invariant="bf16")  # a CPU whose bf16 GEMM were row-invariant: no copy under a budget
    assert int8.plan_of(inv, "invariant") == ("bf16",) * 4
    assert budget.no_copy(inv, "invariant") == ("w8a16",) * 4  # the row-invariant no-copy kernel of least total time


def test_copies_go_where_they_save_the_most_time_per_byte():
    table = {"shapes": {"64x64": entry(saves=30.0), "128x64": entry(saves=40.0), "64x128": entry(saves=5.0)}}
    shapes = [(64, 64), (128, 64), (64, 128), (64, 64)]  # bytes of a copy: 8 KiB, 16 KiB, 16 KiB, 8 KiB
    per_byte = {s: budget.saved_us(table["shapes"][f"{s[0]}x{s[1]}"], "measured") / (2 * s[0] * s[1]) for s in shapes}
    assert per_byte[(64, 64)] > per_byte[(128, 64)] > per_byte[(64, 128)]
    assert budget.copy_plans(shapes, table, "measured", None) == [tuple(PLAN)] * 4  # no limit: the table's plans
    for size, kept in [(0, []), (8 << 10, [0]), (16 << 10, [0, 3]), (20 << 10, [0, 3]), (32 << 10, [0, 1, 3]),
                       (48 << 10, [0, 1, 2, 3])]:  # fmt: skip
        plans = budget.copy_plans(shapes, table, "measured", size)
        assert [i for i, p in enumerate(plans) if "bf16" in p] == kept, size
        assert budget.planned_copy_bytes(shapes, table, "measured", size) == sum(2 * shapes[i][0] * shapes[i][1]
                                                                                 for i in kept) <= size  # fmt: skip
        for i, p in enumerate(plans):
            assert p == (tuple(PLAN) if i in kept else budget.no_copy(table["shapes"]["x".join(map(str, shapes[i]))],
                                                                      "measured"))  # fmt: skip
    assert budget.planned_copy_bytes(shapes, None, "measured", 20 << 10) == 20 << 10  # no table yet: the bound
    with pytest.raises(ValueError, match=">= 0"):
        budget.copy_plans(shapes, table, "measured", -1)


def _table(shapes) -> dict:
    """A table that wants a copy of every linear (``PLAN``), the larger shapes saving more per call; as this CPU's
    table would be: without w8a16 where the int8 GEMM saturates (no VNNI), since its error gate keeps it out."""
    table = {"shapes": {f"{n}x{k}": entry(saves=n * k / 100) for n, k in set(shapes)}}
    if not int_mm_is_exact():
        for e in table["shapes"].values():
            e["choice"] = ["int8mm" if c == "w8a16" else c for c in e["choice"]]
            e["row_invariant"].pop("w8a16")
            for times in e["us"].values():
                times.pop("w8a16")
    return table


def test_a_tiny_model_holds_at_most_its_budget_of_copies_and_answers_as_unbudgeted():
    model = int8_tiny_seed3()
    table = _table(model.int8_shapes())
    prompts = [[5, 9, 33, 7], list(range(40, 50)), list(range(100, 130))]  # M = 44: the third bucket (bf16 there)
    model.use_kernels(table, "measured", 0)
    int8_only = tensor_bytes(model)
    assert all(m.w_bf16 is None and "bf16" not in m.plan for m in model.kernel_modules())
    model.use_kernels(table, "measured")  # no limit: every linear keeps its copy
    full = tensor_bytes(model)
    copies = sum(2 * m.int8_weight()[0].numel() for m in model.kernel_modules())
    assert full == int8_only + copies and all(m.w_bf16 is not None for m in model.kernel_modules())
    want = logits(model, prompts)
    ref = logits(dequantized(model), prompts)
    for frac in (0.0, 0.3, 0.6):
        size = int(frac * copies)
        model.use_kernels(table, "measured", size)
        held = tensor_bytes(model)
        assert int8_only <= held <= int8_only + size, (frac, held - int8_only, size)
        if frac:
            assert held > int8_only  # the budget is used, not only respected
        got = logits(model, prompts)
        assert float((got - want).norm() / want.norm()) < 0.02, frac  # the existing bf16-rounding tolerance
        assert float((got - ref).norm() / ref.norm()) < 0.02, frac
        assert torch.equal(got.argmax(-1), want.argmax(-1)), frac


def test_a_node_load_keeps_its_copies_within_weight_copies_gb(tmp_path, tiny_hf):
    """Through the loader as a node runs it (``weight_copies_gb``), on a cached table of this machine."""
    from compute.modeling.loader import WeightInjector
    from compute.modeling.model import linear_shapes
    from paramstore import ParamStore, StoreConfig

    cache = str(tmp_path / "int8.json")
    with ParamStore(StoreConfig.local_default(str(tmp_path / "store"), k=2, m=1)) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="int8")
        held = {}
        for gb in (-1, 0, 20e3 / 2**30):  # no limit, none, 20 kB
            inj = WeightInjector(store, "tiny", "int8", kernel_cache=cache, measure="blocking", weight_copies_gb=gb)
            if gb == -1:  # the weights are not in yet: their shapes from the config
                shapes = _table(linear_shapes(inj.config))["shapes"]
                int8.save_table(cache, {"version": int8.TABLE_VERSION, "key": int8.machine_key(torch.get_num_threads()),
                                        "shapes": shapes})  # fmt: skip
            assert inj.start().wait(60) and inj.kernel_source == "local"
            held[gb] = sum(m.w_bf16.nbytes for m in inj.model.kernel_modules() if m.w_bf16 is not None)
        assert shapes and held[-1] == sum(2 * m.int8_weight()[0].numel() for m in inj.model.kernel_modules())
        assert held[0] == 0 and 0 < held[20e3 / 2**30] <= 20e3
