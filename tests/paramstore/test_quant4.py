"""INT4 as a store dtype: the scheme's round trip and layout, an import through the store and through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from paramstore import InvalidRequest, ParamStore
from paramstore.quant4 import GROUP, dequantize_int4, pack, quantize_int4, unpack
from paramstore.sources import layer_of


def test_round_trip_error_is_at_most_half_a_step_per_group():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    w[3] = 0.25  # a constant row: every group exact
    packed, scale, zero = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 48)
    assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == zero.shape == (48, 96 // GROUP)
    deq = dequantize_int4(packed, scale, zero)
    step = scale.float().repeat_interleave(GROUP, 1)
    # half a step of rounding, plus the bf16 rounding of zero (the codes are taken against the rounded pair)
    assert torch.all((deq - w).abs() <= step * 0.5 + zero.float().abs().repeat_interleave(GROUP, 1) * 2**-8 + 1e-6)
    assert torch.equal(deq[3], w[3])
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.12  # 4 bits: ~8% on normal weights, far above int8's ~1%


def test_pack_layout_even_column_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack(q)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack(packed), q)


def test_codes_use_the_whole_range_and_dequantize_with_the_middle_code_at_zero():
    w = torch.linspace(-1, 2, GROUP)[None, :].repeat(2, 1)
    packed, scale, zero = quantize_int4(w)
    q = unpack(packed)
    assert q.min() == 0 and q.max() == 15
    assert torch.allclose(dequantize_int4(pack(torch.full_like(q, 8)), scale, zero), zero.float().repeat(1, GROUP))


def test_bad_shapes_fail_clearly():
    with pytest.raises(ValueError, match="K % 32"):
        quantize_int4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(64))


def test_store_import_int4_layers_int8_embedding(memory_store_config, tiny_hf):
    folder, _, tensors = tiny_hf
    with ParamStore(memory_store_config) as store:
        res = store.import_model(folder, "tiny", dtype="int4")
        m = res.manifest
        assert m.dtype == "int4" and m.quant["scheme"] == "int4-asym-g32" and m.quant["group_size"] == GROUP
        with store.reader(m) as r:
            sd = r.state_dict()
        with pytest.raises(InvalidRequest, match="int4"):
            store.import_model(folder, "tiny", dtype="int3")
        int8_bytes = store.import_model(folder, "tiny8").manifest.model_bytes
    int4 = [n for n, t in tensors.items() if t.dim() == 2 and layer_of(n) is not None]
    assert int4 and res.quant_error["int4_tensors"] == len(int4) and res.quant_error["tensors"] == len(int4) + 2
    for name, t in tensors.items():
        if name in int4:
            got = dequantize_int4(sd[name], sd[name + "_scale"], sd[name + "_zero"])
            assert sd[name].shape == (t.shape[0], t.shape[1] // 2)
            assert ((got - t).norm() / t.norm()) < 0.12, name
        elif t.dim() == 2:  # embedding, lm_head: int8
            assert sd[name].dtype == torch.int8 and name + "_zero" not in sd, name
        else:
            assert torch.equal(sd[name], t), name
    assert m.model_bytes < 0.8 * int8_bytes, (m.model_bytes, int8_bytes)


def test_cli_import_dtype_int4_in_a_subprocess(tmp_path, tiny_hf):
    base = [sys.executable, "-m", "paramstore.cli", "-q", *sum((["--store", str(tmp_path / f"l{i}")] for i in range(6)), [])]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([*base, "import", tiny_hf[0], "--name", "tiny", "--dtype", "int4", "--k", "4", "--m", "2", "--json"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["dtype"] == "int4" and info["quant_error"]["int4_tensors"] > 0
    p = subprocess.run([*base, "show", "tiny", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and json.loads(p.stdout)["quant"]["scheme"] == "int4-asym-g32", p.stderr


def test_cli_prints_the_int4_summary_and_refuses_other_dtypes(tmp_path, tiny_hf, capsys):
    from paramstore.cli import main

    stores = ["-q", *sum((["--store", str(tmp_path / f"l{i}")] for i in range(6)), [])]
    assert main([*stores, "import", tiny_hf[0], "--name", "tiny", "--dtype", "int4", "--k", "4", "--m", "2"]) == 0
    out = capsys.readouterr().out
    assert "int4 + 2 int8 quantization" in out and "relative RMS error" in out, out
    with pytest.raises(SystemExit):
        main([*stores, "import", tiny_hf[0], "--name", "tiny", "--dtype", "int2"])
    assert "invalid choice" in capsys.readouterr().err
