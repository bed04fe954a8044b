"""Every tensor a model hands to a kernel is 64-byte aligned, on any CPU.

The AVX-512 ``_weight_int8pack_mm`` segfaults on int8 weights at 8 or 40 (mod 64) (table in
``compute.kernels.linear``); AVX2 runs them, so only an alignment check catches a regression there.
Alignment comes by construction: ``paramstore.shards.pack`` puts tensor data at 64-byte
offsets, the reader and the disk tier decode into 64-byte aligned buffers
(``paramstore.buffers.alloc``), and ``Transformer.load_weights`` copies whatever is still
misaligned (an older blob) once, counted in ``aligned_copies``.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from compute.kernels.linear import ALIGN, LinearPart
from compute.modeling.batch import ForwardBatch
from compute.modeling.config import ModelConfig
from compute.modeling.kv_cache import KVCache
from compute.modeling.loader import WeightInjector
from compute.modeling.model import Transformer
from paramstore import ParamStore, StoreConfig
from paramstore.buffers import alloc
from paramstore.cache import CacheConfig, NodeCache
from paramstore.shards import ShardPlan, pack, unpack
from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder


def kernel_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and tensor attributes of every module
    (``FusedLinear.w/scale/scale_bf16/b``, ``_scale_act``, ``inv_freq``...), by qualified name.

    A ``LinearPart``'s tensors are views of its fused buffer, never a kernel's input: they are
    left out, after checking that they do view it (so the fused buffer is what runs)."""
    out = {}
    for mname, mod in model.named_modules():
        named = {**mod._parameters, **mod._buffers, **{k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}}
        if isinstance(mod, LinearPart):
            fused_w = mod._fused.w
            assert fused_w is not None and mod.weight.untyped_storage().data_ptr() == fused_w.untyped_storage().data_ptr()
            continue
        for k, t in named.items():
            if t is not None and not t.is_meta and t.numel():
                out[f"{mname}.{k}" if mname else k] = t
    return out


def misaligned(model: Transformer) -> dict[str, int]:
    """name -> address mod ``ALIGN`` of every held tensor that is not aligned."""
    return {n: t.data_ptr() % ALIGN for n, t in kernel_tensors(model).items() if t.data_ptr() % ALIGN}


def assert_every_kind_seen(names, int8: bool) -> None:
    """The walk found each kind of tensor (so an empty walk cannot pass)."""
    kinds = [".qkv.w", ".gate_up.w", ".o_proj.weight", ".down_proj.weight", "embed_tokens.weight", "norm.weight",
             "lm_head.weight", "inv_freq"]  # fmt: skip
    if int8:
        kinds += [".qkv.scale", ".qkv.scale_bf16", ".o_proj.weight_scale", ".o_proj._scale_act", "embed_tokens._scale_act"]
    for kind in kinds:
        assert any(n.endswith(kind) for n in names), (kind, sorted(names)[:20])


def _inject(locations, name: str, weights: str, cache=None) -> Transformer:
    store = ParamStore(StoreConfig(locations=locations))
    try:
        inj = WeightInjector(store, name, weights, cache=cache).start()
        assert inj.wait(120)
    finally:
        store.close()
    return inj.model


@pytest.fixture(scope="module")
def tiny_stores(tmp_path_factory):
    """(locations, name, vocab) of tiny Llamas imported int8 and fp32. vocab 300 makes the fp32
    scale of the embedding 1200 bytes (not a multiple of 64): the int8 table packed after it
    sits at a misaligned offset, which injection must copy."""
    out = {}
    for vocab in (256, 300):
        cfg = tiny_llama_config(layers=2, vocab=vocab, tied=vocab == 300)
        folder = write_hf_folder(tmp_path_factory.mktemp(f"hf{vocab}"), cfg, tiny_llama_tensors(cfg))
        for dtype in ("int8", "fp32"):
            sc = StoreConfig.local_default(str(tmp_path_factory.mktemp(f"store{vocab}{dtype}")), k=4, m=2,
                                           shard_bytes=64 * 1024)  # fmt: skip
            with ParamStore(sc) as store:
                store.import_model(folder, "tiny", dtype=dtype)
            out[vocab, dtype] = sc.locations
    return out


@pytest.mark.parametrize("vocab", [256, 300])
@pytest.mark.parametrize("stored, weights", [("int8", "int8"), ("int8", "bf16"), ("fp32", "fp32")])
@pytest.mark.parametrize("via", ["store", "disk-cache-hit"])
def test_injected_tiny_model_holds_only_aligned_tensors(tiny_stores, tmp_path, vocab, stored, weights, via):
    cache = None
    if via == "disk-cache-hit":  # a first node fills the disk tier; a second one reads it back from there
        cfg = CacheConfig(str(tmp_path / "cache"), disk_bytes=2**30, memory_bytes=0)
        _inject(tiny_stores[vocab, stored], "tiny", weights, NodeCache(cfg))
        cache = NodeCache(cfg)
    model = _inject(tiny_stores[vocab, stored], "tiny", weights, cache)
    if cache is not None:
        assert cache.stats()["hits_disk"] > 0
    held = kernel_tensors(model)
    assert_every_kind_seen(held, int8=weights == "int8")
    assert not misaligned(model), misaligned(model)
    if vocab == 256:  # every tensor size a multiple of 64: aligned buffers and offsets, nothing copied
        assert model.aligned_copies == 0
    elif weights == "int8":  # safetensors packs the fp32 scale (1200 bytes) before the int8 table
        assert model.aligned_copies >= 1


def test_packed_shard_puts_tensor_data_at_64_byte_offsets():
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randint(-127, 128, (192, 576), generator=g, dtype=torch.int8),
               "a.weight_scale": torch.rand(192, generator=g), "b.weight": torch.rand(576, generator=g),
               "c.weight": torch.randint(-127, 128, (1536, 576), generator=g, dtype=torch.int8)}  # fmt: skip
    for meta in ({}, {"scheme": "x" * 13}, {"scheme": "x" * 37}):  # header lengths that differ mod 64
        blob = pack(ShardPlan("layers", [0], dict(tensors)), meta)
        (n,) = struct.unpack_from("<Q", blob, 0)
        header = json.loads(blob[8 : 8 + n])
        header.pop("__metadata__")
        assert (8 + n) % ALIGN == 0 and all((8 + n + h["data_offsets"][0]) % ALIGN == 0 for h in header.values())
        assert {k: v.equal(tensors[k]) for k, v in st_load(blob).items()} == dict.fromkeys(tensors, True)  # still safetensors
        buf = alloc(len(blob))
        buf[:] = blob
        views, md = unpack(buf)
        assert md["kind"] == "layers" and all(v.data_ptr() % ALIGN == 0 for v in views.values())
        assert all(views[k].equal(t) for k, t in tensors.items())


def _old_style_blob(tensors: dict[str, torch.Tensor]) -> bytes:
    """``safetensors.torch.save`` as pack wrote it before the alignment: a header length chosen so
    the data starts at 8 (mod 64), the address that faulted."""
    for i in range(64):
        blob = st_save(tensors, metadata={"kind": "layers", "pad": "x" * i})
        if (8 + struct.unpack_from("<Q", blob, 0)[0]) % ALIGN == 8:
            return blob
    raise AssertionError("no header length gives data at 8 mod 64")


def test_old_unpadded_blob_still_unpacks_and_loads_aligned(tiny_stores):
    """A shard packed before the alignment unpacks to misaligned views; load_weights copies them."""
    store = ParamStore(StoreConfig(locations=tiny_stores[256, "int8"]))
    try:
        manifest = store.manifest("tiny")
        with store.reader(manifest) as r:
            stored = {k: v.clone() for read in r.iter_shards() for k, v in read.tensors()[0].items()}
    finally:
        store.close()
    blob = _old_style_blob(stored)
    buf = alloc(len(blob))  # an aligned buffer: only the blob's own offsets misalign the views
    buf[:] = blob
    views, _ = unpack(buf)
    assert all(views[k].equal(t) for k, t in st_load(blob).items())
    off = {k: v.data_ptr() % ALIGN for k, v in views.items()}
    assert sum(o != 0 for o in off.values()) >= len(off) // 2, off  # the control: most views ARE misaligned

    config = ModelConfig.from_hf(manifest.config)
    old, ref = Transformer.build(config), Transformer.build(config)
    old.load_weights(views)
    ref.load_weights(stored)  # torch-owned clones: aligned, nothing copied
    assert old.ready and not misaligned(old), misaligned(old)
    assert old.aligned_copies == sum(o != 0 for o in off.values()) and ref.aligned_copies == 0
    assert_every_kind_seen(kernel_tensors(old), int8=True)
    ids = (torch.arange(8) * 7 % config.vocab_size).tolist()  # M = 8: a size that faulted
    fb = ForwardBatch.build([ids], [0], [[0]], 16, all_logits=True)
    assert torch.equal(old(fb, KVCache(config, 1, 16)), ref(fb, KVCache(config, 1, 16)))


@pytest.mark.slow
def test_real_model_injects_aligned_with_zero_copies(real_model_store):
    """SmolLM2 freshly imported (int8): every tensor aligned, and none of them had to be copied."""
    locations, name = real_model_store
    model = _inject(locations, name, "int8")
    held = kernel_tensors(model)
    assert_every_kind_seen(held, int8=True)
    assert not misaligned(model), misaligned(model)
    assert model.aligned_copies == 0
    assert model.model.embed_tokens.weight.dtype == torch.int8 and tuple(model.lm_head.weight.shape) == (49152, 576)
