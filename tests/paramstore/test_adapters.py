"""LoRA adapters as store objects: ``paramstore import-adapter`` run as the user runs it, then listed, shown,
verified, read back from any k of n fragments, re-imported as a new version; what cannot be served is refused
with one line and nothing written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from paramstore import ParamStore, StoreConfig
from paramstore.lora import check, read_peft
from tests.cli import PARAMSTORE, run
from tests.lora import save_peft_adapter

from .damage import lose


@pytest.fixture(scope="module")
def adapters(tiny_hf, tmp_path_factory):
    """Two PEFT adapters of the tiny model (another rank and targets each) and one DoRA adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**tiny_hf[1])).eval()
    hf.load_state_dict(tiny_hf[2], strict=False)
    out = {}
    for i, (name, options) in enumerate({
        "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
        "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True),
    }.items()):  # fmt: skip
        out[name] = tmp_path_factory.mktemp(name)
        save_peft_adapter(hf, options, out[name], seed=i)
    return out


@pytest.fixture
def store(tmp_path, tiny_hf):
    args = ["-q"] + sum((["--store", str(tmp_path / f"loc{i}")] for i in range(6)), [])
    r = run(PARAMSTORE + args + ["import", tiny_hf[0], "--name", "tiny", "--k", "4", "--m", "2"], timeout=120)
    assert r.returncode == 0, r.stderr
    return args, StoreConfig([str(tmp_path / f"loc{i}") for i in range(6)], k=4, m=2)


def _files(tmp_path) -> int:
    return sum(len(f) for _, _, f in os.walk(tmp_path))


def test_import_adapter_then_ls_show_verify_and_read_back(store, adapters, tiny_hf):
    args, cfg = store
    r = run(PARAMSTORE + args + ["import-adapter", str(adapters["qv"]), "--base", "tiny", "--name", "tiny-qv",
                                 "--json"], timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["adapter"] == "tiny-qv@v1" and info["base"] == "tiny@v1"  # the base's version pinned
    assert info["ranks"] == [4] and info["targets"] == ["q_proj", "v_proj"]
    ls = json.loads(run(PARAMSTORE + args + ["ls", "--json"]).stdout)
    rows = {row["name"]: row for row in ls}
    assert rows["tiny"]["adapter"] is None and rows["tiny-qv"]["adapter"]["base"] == "tiny@v1"
    text = run(PARAMSTORE + args + ["ls"]).stdout
    assert "LoRA of tiny@v1, r 4, q_proj,v_proj" in text
    shown = run(PARAMSTORE + args + ["show", "tiny-qv"])
    assert shown.returncode == 0 and "LoRA adapter of tiny@v1: rank 4" in shown.stdout
    deep = run(PARAMSTORE + args + ["verify", "tiny-qv", "--deep", "--json"], timeout=120)
    assert deep.returncode == 0 and json.loads(deep.stdout)["summary"]["unrecoverable"] == 0

    source = check(*read_peft(adapters["qv"]), tiny_hf[1])
    with ParamStore(cfg) as ps:
        m = ps.manifest("tiny-qv")
        for shard in m.weight_shards():
            lose(ps, m, shard, (0, 5))  # two of six fragments gone: any four still give the shard
        got = ps.adapter("tiny-qv")
    assert got.digest() == source.digest() == m.adapter["digest"]
    for a, b in zip(got.targets, source.targets):
        assert (a.layer, a.proj, a.scaling) == (b.layer, b.proj, b.scaling)
        assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b)


def test_reimport_is_a_new_version_with_its_own_digest(store, adapters):
    args, cfg = store
    for src in ("qv", "mlp"):
        r = run(PARAMSTORE + args + ["import-adapter", str(adapters[src]), "--base", "tiny@v1", "--name", "style"],
                timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr
    with ParamStore(cfg) as ps:
        v1, v2 = ps.manifest("style@v1"), ps.manifest("style@v2")
        assert v1.adapter["digest"] != v2.adapter["digest"] and v2.adapter["targets"] == ["down_proj", "gate_proj",
                                                                                          "up_proj"]  # fmt: skip
        assert ps.adapter("style").ranks == [8]
    assert run(PARAMSTORE + args + ["rm", "style@v1"]).returncode == 0
    rows = {row["name"]: row for row in json.loads(run(PARAMSTORE + args + ["ls", "--json"]).stdout)}
    assert rows["style"]["versions"] == ["v2"] and rows["tiny"]["versions"] == ["v1"]


@pytest.mark.parametrize("argv, names", [
    (["dora", "--base", "tiny", "--name", "x"], "DoRA"),
    (["qv", "--base", "nope", "--name", "x"], "nope"),
    (["qv", "--base", "tiny", "--name", "tiny"], "base's name"),
    (["qv", "--base", "tiny", "--name", "x@v2"], "not a version"),
    ([None, "--base", "tiny", "--name", "x"], "adapter_config.json"),
])  # fmt: skip
def test_what_cannot_be_imported_is_one_line_and_nothing_is_written(store, adapters, tmp_path, argv, names):
    args, cfg = store
    before = _files(tmp_path)
    src = str(tmp_path / "missing") if argv[0] is None else str(adapters[argv[0]])
    r = run(PARAMSTORE + args + ["import-adapter", src, *argv[1:]], timeout=120)
    assert r.returncode == 2 and names in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and _files(tmp_path) == before
