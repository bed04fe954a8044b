"""The per-step breakdown and the weight-memory count of `pdserve bench engine` on a tiny int8 model."""

from __future__ import annotations

import torch

from benchmarks.step_profile import PARTS, breakdown, format_breakdown, weight_bytes
from compute.modeling.model import Transformer
from tests.compute.tiny import int8_state, tiny_model


def _tiny_int8() -> Transformer:
    ref = tiny_model()
    model = Transformer.build(ref.config, torch.float32)
    model.load_weights(int8_state(dict(ref.state_dict())))
    assert model.ready and model.kernel_modules()
    return model


def test_breakdown_accounts_for_the_step():
    model = _tiny_int8()
    for n in (1, 3):
        b = breakdown(model, [[1, 2, 3, 4, 5]] * n, steps=3)
        assert b["streams"] == n and b["step_ms"] > 0 and b["aten_calls"] > 0 and b["gemv_floor_ms"] > 0
        assert set(PARTS) <= set(b["parts"]) and b["parts"]["gemv kernels"] > 0
        assert all(v >= 0 for v in b["parts"].values())
        assert "ms per step" in format_breakdown(b)


def test_weight_bytes_counts_each_tensor_once():
    model = _tiny_int8()
    w = weight_bytes(model)
    expect = sum(m.int8_weight()[0].nbytes for m in model.kernel_modules())
    embed = 0 if model.config.tie_word_embeddings else model.model.embed_tokens.weight.nbytes
    assert w["int8"] == expect + embed
    # fused buffers once (not again through their parts' views); a tied head shares the embedding's bytes
    assert w["bf16 copies"] == 0  # no plan yet: no copy
    model.use_kernels({"shapes": {f"{n}x{k}": {"choice": ["int8mm", "bf16", "bf16", "bf16"], "invariant": None}
                                  for n, k in model.int8_shapes()}})  # fmt: skip
    assert weight_bytes(model)["bf16 copies"] == 2 * expect


def test_report_prints_memory_and_skips_the_variants(capsys):
    from benchmarks.step_profile import report

    model = _tiny_int8()
    out = report({"ours-int8": model, "ours-int8-fixed": model}, [[1, 2, 3]], [], "tiny")
    assert set(out["breakdown"]) == {"ours-int8"} and len(out["breakdown"]["ours-int8"]) == 2
    assert set(out["weight_bytes"]) == {"ours-int8", "ours-int8-fixed"}
    assert "runtime weights" in capsys.readouterr().out
