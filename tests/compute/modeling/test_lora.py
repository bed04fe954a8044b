"""LoRA adapters against PEFT itself: a tiny random Llama, adapters saved by PEFT's ``save_pretrained``, read and
checked by ``paramstore.lora``, applied per row by ``compute.modeling.lora``; the reference is PEFT's own unmerged
forward (transformers + PEFT, fp32)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.lora import LoraRows, LoraWeights
from compute.modeling.model import Transformer
from paramstore.lora import LoraAdapter, UnservableAdapter, check, read_peft
from tests.lora import save_peft_adapter

torch.set_num_threads(2)
TOL = 1e-4
BLOCK = 8
BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "initializer_range": 0.1, "tie_word_embeddings": False}  # fmt: skip

ADAPTERS = {  # the PEFT options a served adapter may use
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"],
                         rank_pattern={"down_proj": 8, "layers.1.self_attn.k_proj": 2}, alpha_pattern={"o_proj": 32}),
    "rslora-regex": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=r".*\.mlp\.(gate|up)_proj"),
}  # fmt: skip


def _base():
    torch.manual_seed(1234)
    hc = LlamaConfig(**BASE)
    hf = LlamaForCausalLM(hc).eval()
    d = json.loads(hc.to_json_string()) | {"architectures": ["LlamaForCausalLM"]}
    return hf, d


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf, d = _base()
    ours = Transformer.build(ModelConfig.from_hf(d))
    ours.load_weights(hf.state_dict())
    dirs = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        dirs[name] = tmp_path_factory.mktemp(name)
        save_peft_adapter(hf, options, dirs[name], seed=i)
    return hf, d, ours, dirs


def _peft_logits(hf, path, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, str(path)).eval()
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]  # [V]
    finally:
        model.unload()


def _weights(d: dict, path) -> LoraWeights:
    adapter = check(*read_peft(path), d)
    return LoraWeights(adapter.targets, ModelConfig.from_hf(d))


def _last_logits(model, prompts: list[list[int]], adapters: list) -> torch.Tensor:
    """Each prompt's last-token logits, all in one forward, prompt ``i`` under ``adapters[i]``."""
    tables = [[i * 8 + j for j in range(8)] for i in range(len(prompts))]
    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, BLOCK)
    batch.lora = LoraRows.of(adapters, [len(p) for p in prompts])
    return model(batch, KVCache(model.config, 8 * len(prompts), BLOCK))


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_logits_equal_peft_unmerged(setup, name):
    hf, d, ours, dirs = setup
    ids = random.Random(0).choices(range(BASE["vocab_size"]), k=21)
    ref = _peft_logits(hf, dirs[name], ids)
    with torch.no_grad():
        base = hf(torch.tensor([ids])).logits[0, -1]
    assert (ref - base).abs().max() > 0.05  # the adapter changes the answer: the check below can fail
    got = _last_logits(ours, [ids], [_weights(d, dirs[name])])[0]
    assert (got - ref).abs().max() <= TOL


def test_mixed_batch_rows_get_what_they_get_alone(setup):
    """Base and three adapters in one forward: each row's logits are those it gets alone."""
    hf, d, ours, dirs = setup
    rng = random.Random(5)
    ws = [_weights(d, dirs[n]) for n in ADAPTERS]
    prompts = [rng.choices(range(BASE["vocab_size"]), k=k) for k in (9, 7, 14, 5, 11)]
    adapters = [ws[0], ws[0], None, ws[1], ws[2]]  # each adapter's sequences together, as the runner orders them
    mixed = _last_logits(ours, prompts, adapters)
    for i, (p, w) in enumerate(zip(prompts, adapters)):
        alone = _last_logits(ours, [p], [w])[0]
        assert (mixed[i] - alone).abs().max() <= 1e-5, i
    assert (mixed[0] - _last_logits(ours, [prompts[0]], [None])[0]).abs().max() > 0.05  # the adapter applied
    with pytest.raises(ValueError, match="next to each other"):  # rows of one adapter apart: refused, not wrong
        LoraRows.of([ws[0], None, ws[0]], [3, 2, 4])


def test_on_int8_weights_with_invariant_kernels_a_mixed_batch_is_bitwise_each_row_alone(setup):
    """``kernels = invariant``: the int8 base on its row-invariant kernel and every adapter row through the native
    kernel (bf16 pairs, as a node keeps them on a quantized base): base + 3 adapters in one forward give each row
    bit for bit the logits it gets alone."""
    from compute.kernels import native
    from compute.modeling.lora import pair_dtype
    from tests.compute.tiny import int8_state

    if not native.available():
        pytest.skip(f"native kernels not built: {native.why_unavailable()}")
    hf, d, _, dirs = setup
    m = Transformer.build(ModelConfig.from_hf(d), torch.float32)
    m.load_weights(int8_state(hf.state_dict()))
    for lin in m.kernel_modules():
        lin.use_kernels(("int8mm",) * 4)
    ws = [LoraWeights(check(*read_peft(dirs[n]), d).targets, m.config, dtype=pair_dtype("int8"), invariant=True)
          for n in ADAPTERS]  # fmt: skip
    rng = random.Random(6)
    prompts = [rng.choices(range(BASE["vocab_size"]), k=k) for k in (9, 7, 14, 5, 11, 6)]
    adapters = [ws[0], ws[0], None, ws[1], ws[2], ws[2]]
    mixed = _last_logits(m, prompts, adapters)
    for i, (p, w) in enumerate(zip(prompts, adapters)):
        assert torch.equal(mixed[i], _last_logits(m, [p], [w])[0]), i
    assert not torch.equal(mixed[0], _last_logits(m, [prompts[0]], [None])[0])  # the adapter applied


def test_rank_is_not_padded_and_no_zeros_are_kept(setup):
    hf, d, ours, dirs = setup
    w = _weights(d, dirs["all-patterns"])
    a, parts = w.pairs[(1, "qkv")]
    assert a.shape == (4 + 2 + 4, 64)  # A: q r4, k r2 (rank_pattern), v r4 stacked: one pass for h
    assert [(c.start, c.stop, h.start, h.stop, tuple(b.shape)) for c, h, b in parts] == [
        (0, 64, 0, 4, (4, 64)), (64, 96, 4, 6, (2, 32)), (96, 128, 6, 10, (4, 32))]  # each B^T its own, no zeros
    assert w.pairs[(0, "down")][0].shape == (8, 160)  # down_proj's own rank 8, the others' 4 untouched
    qv = _weights(d, dirs["qv-r4"])
    assert set(qv.pairs) == {(0, "qkv"), (1, "qkv")}
    assert [c for c, _, _ in qv.pairs[(0, "qkv")][1]] == [slice(0, 64), slice(96, 128)]  # k's rows untouched


def test_canonical_form_round_trips_with_the_same_digest(setup):
    hf, d, ours, dirs = setup
    adapter = check(*read_peft(dirs["all-patterns"]), d)
    back = LoraAdapter.from_canonical(adapter.tensors(), adapter.scalings(), adapter.config)
    assert back.digest() == adapter.digest() and back.ranks == [2, 4, 8]
    assert {t.proj: t.scaling for t in back.targets}["o_proj"] == 32 / 4
    other = check(*read_peft(dirs["qv-r4"]), d)
    assert other.digest() != adapter.digest()


@pytest.mark.parametrize("change, names", [
    (lambda c, t: c.update(use_dora=True), "DoRA"),
    (lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c, t: c.update(bias="lora_only"), "bias 'lora_only'"),
    (lambda c, t: c.update(peft_type="IA3"), "peft_type IA3"),
    (lambda c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "lm_head"),
    (lambda c, t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 320)}),
     "embedding"),
    (lambda c, t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"), "lora_B is missing"),
    (lambda c, t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 63)}),
     "do not fit"),
    (lambda c, t: t.update({"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}),
     "layer 7, the base has 2"),
    (lambda c, t: c.update(r=8), "rank 4 in the tensors, 8 in adapter_config.json"),
])  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_it(setup, change, names):
    hf, d, ours, dirs = setup
    config, tensors = read_peft(dirs["qv-r4"])
    change(config, tensors)
    with pytest.raises(UnservableAdapter, match=names):
        check(config, tensors, d)
