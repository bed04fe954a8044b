"""Import/read round trips, layout, integrity, repair and publish semantics of the store."""

from __future__ import annotations

import itertools
import json
import os
import threading

import pytest
import torch

from paramstore import (
    IntegrityError,
    InvalidRequest,
    NotEnoughFragments,
    NotFound,
    ParamStore,
    ReaderConfig,
    StoreConfig,
    dequantize_int8,
)
from paramstore.sources import layer_of

from .damage import flip_bit, lose


@pytest.fixture
def store(memory_store_config):
    with ParamStore(memory_store_config) as s:
        yield s


@pytest.mark.parametrize("dtype,cast", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_float_round_trip_is_bit_identical(store, tiny_hf, dtype, cast):
    folder, _, tensors = tiny_hf
    m = store.import_model(folder, "tiny", dtype=dtype).manifest
    with store.reader(m) as r:
        sd = r.state_dict()
        bundle = r.bundle()
    assert set(sd) == set(tensors)
    for name, t in tensors.items():
        assert sd[name].dtype == cast and torch.equal(sd[name], t.to(cast)), name
    assert "tokenizer_config.json" in bundle and json.loads(bundle["tokenizer_config.json"])["chat_template"]


def test_int8_round_trip_within_quantization_bound(store, tiny_hf):
    folder, _, tensors = tiny_hf
    res = store.import_model(folder, "tiny")
    assert res.manifest.dtype == "int8" and res.manifest.quant["scheme"] == "int8-absmax-per-row"
    assert 0 < res.quant_error["rel_rmse"] < 0.02
    with store.reader(res.manifest) as r:
        sd = r.state_dict()
    for name, t in tensors.items():
        if t.dim() == 2:
            q, scale = sd[name], sd[name + "_scale"]
            assert q.dtype == torch.int8 and scale.shape == (t.shape[0],)
            err = (dequantize_int8(q, scale) - t).abs()
            assert torch.all(err <= scale[:, None] / 2 + 1e-7), name  # rounding error <= half a step
        else:
            assert torch.equal(sd[name], t), name  # norms keep their dtype


def test_shards_are_layer_aligned_and_self_describing(memory_store_config, tiny_hf):
    folder, cfg, _ = tiny_hf
    memory_store_config.shard_bytes = 90 * 1024  # two int8 blocks (~40 KiB each) fit, three do not
    with ParamStore(memory_store_config) as store:
        m = store.import_model(folder, "tiny").manifest
        kinds = [s.kind for s in m.shards]
        assert kinds[0] == "bundle" and kinds[1] == "embed" and kinds[-1] == "head"
        blocks = [s.layers for s in m.shards if s.kind == "layers"]
        assert blocks == [[0, 1], [2, 3]]
        with store.reader(m) as r:
            for read in r.iter_shards():
                tensors, meta = read.tensors()
                assert json.loads(meta["layers"]) == read.shard.layers and meta["kind"] == read.shard.kind
                for name in tensors:  # every tensor belongs to a block the shard lists
                    layer = layer_of(name)
                    assert (layer in read.shard.layers) if layer is not None else read.shard.kind != "layers"


def test_block_larger_than_target_is_split(memory_store_config, tiny_hf):
    folder, _, tensors = tiny_hf
    memory_store_config.shard_bytes = 16 * 1024
    with ParamStore(memory_store_config) as store:
        m = store.import_model(folder, "tiny").manifest
        layer_shards = [s for s in m.shards if s.kind == "layers"]
        assert len(layer_shards) > 4 and all(len(s.layers) == 1 for s in layer_shards)
        with store.reader(m) as r:
            assert set(r.state_dict()) == {n for n in tensors} | {n + "_scale" for n, t in tensors.items() if t.dim() == 2}


def test_placement_spreads_each_shard_over_distinct_locations(store, tiny_hf):
    m = store.import_model(tiny_hf[0], "tiny").manifest
    for s in m.shards:
        locs = [f.location for f in s.fragments]
        assert len(set(locs)) == m.n
    assert len({s.fragments[0].location for s in m.shards}) > 1  # rotation differs per shard


LOSS_PATTERNS = [c for r in range(0, 4) for c in itertools.combinations(range(6), r)]


@pytest.mark.parametrize("lost", LOSS_PATTERNS, ids=lambda c: "lost-" + ("-".join(map(str, c)) or "none"))
def test_loss_table(memory_store_config, tiny_hf, lost):
    """k=4, m=2: any <= 2 lost fragments per shard read back identical; 3 lost raise NotEnoughFragments."""
    folder = tiny_hf[0]
    with ParamStore(memory_store_config) as store:
        m = store.import_model(folder, "tiny", dtype="fp32").manifest
        with store.reader(m) as r:
            want = r.state_dict()
        for s in m.shards:
            lose(store, m, s, lost)
        with store.reader(m, ReaderConfig(verify_digest="always")) as r:
            if len(lost) <= m.m:
                got = r.state_dict()
                assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
                assert all(r.read(s).degraded == sum(i < m.k for i in lost) for s in m.shards)
            else:
                with pytest.raises(NotEnoughFragments) as e:
                    r.state_dict()
                assert "need 4 good fragments" in str(e.value) and e.value.failed


def test_losing_one_location_costs_at_most_one_fragment_per_shard(memory_store_config, tiny_hf):
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny").manifest
        dead = store.locations[2]
        for rel in dead.list("shards"):
            dead.remove(rel)
        report = store.verify("tiny")
        assert all(h.status == "degraded" and len(h.bad) == 1 for h in report if h.bad)
        assert sum(bool(h.bad) for h in report) == len(m.shards)  # 6 locations, n=6: every shard had one there
        with store.reader(m) as r:
            assert r.state_dict()


def test_flipped_bit_is_detected_and_repaired(store, tiny_hf):
    m = store.import_model(tiny_hf[0], "tiny", dtype="fp32").manifest
    shard = m.shards[2]
    flip_bit(store, m, shard, index=1)
    assert store.verify("tiny")[2].status == "ok"  # fast verify only checks sizes
    deep = store.verify("tiny", deep=True)
    assert deep[2].status == "degraded" and "xxh3" in deep[2].bad[0]["reason"]
    with store.reader(m) as r:  # reads still succeed, from parity
        assert r.read(shard).degraded == 1
    fixed = store.repair("tiny")
    assert fixed[2].repaired == 1
    assert all(h.status == "ok" for h in store.verify("tiny", deep=True))
    with store.reader(m) as r:
        assert r.read(shard).degraded == 0


def test_unrecoverable_shard_is_reported(store, tiny_hf):
    m = store.import_model(tiny_hf[0], "tiny").manifest
    lose(store, m, m.shards[1], (0, 1, 5))
    report = store.verify("tiny")
    assert report[1].status == "unrecoverable"
    assert store.repair("tiny")[1].status == "unrecoverable"


def test_hmac_signed_manifest_detects_tampering(memory_store_config, tiny_hf):
    memory_store_config.hmac_key = b"secret"
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny").manifest
        rel = f"models/tiny/v{m.version:06d}.json"
        for loc in store.locations:
            doc = json.loads(loc.get(rel))
            doc["manifest"]["shards"][1]["fragments"][0]["xxh3"] = "0" * 32
            body = json.dumps(doc["manifest"], sort_keys=True, separators=(",", ":")).encode()
            import hashlib

            doc["integrity"]["sha256"] = hashlib.sha256(body).hexdigest()  # attacker fixes the plain hash
            loc.put(rel, json.dumps(doc).encode())
        with pytest.raises(IntegrityError, match="HMAC"):
            store.manifest("tiny")
    unsigned = StoreConfig(memory_store_config.locations, k=4, m=2, hmac_key=b"other")
    with ParamStore(unsigned) as s2, pytest.raises(IntegrityError):
        s2.manifest("tiny")


def test_corrupt_manifest_copy_falls_back_to_another(store, tiny_hf):
    m = store.import_model(tiny_hf[0], "tiny").manifest
    store.locations[0].put(f"models/tiny/v{m.version:06d}.json", b"{garbage")
    assert store.manifest("tiny").shards == m.shards


def test_concurrent_imports_make_two_versions(store, tiny_hf):
    results, errors = [], []

    def run():
        try:
            results.append(store.import_model(tiny_hf[0], "tiny").manifest.version)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(results) == [1, 2]
    assert store.models() == {"tiny": [1, 2]}
    for v in (1, 2):
        assert store.manifest(f"tiny@v{v}").version == v


def test_interrupted_import_leaves_nothing_visible_and_gc_cleans(memory_store_config, tiny_hf):
    from paramstore.sources import open_source

    src = open_source(tiny_hf[0])
    real = src.load_tensor

    def dying(name):
        if name.startswith("model.layers.2."):
            raise KeyboardInterrupt  # like Ctrl-C mid-import
        return real(name)

    src.load_tensor = dying
    with ParamStore(memory_store_config) as store:
        with pytest.raises(KeyboardInterrupt):
            store.import_model(src, "tiny")
        assert store.models() == {}
        # simulate a crash that skipped the cleanup: write orphans by hand
        store.locations[0].put("shards/ab/abcdef.k4n6.f000", b"orphan")
        assert store.gc(grace_s=3600)["removed"] == 0  # young orphans could be an import in flight
        out = store.gc(grace_s=0)
        assert out["removed"] >= 1
        assert all(loc.list("shards") == [] for loc in store.locations)


def test_gc_keeps_referenced_and_rm_then_gc_frees(store, tiny_hf):
    store.import_model(tiny_hf[0], "tiny")
    store.import_model(tiny_hf[0], "tiny", dtype="bf16")
    assert store.gc(grace_s=0)["removed"] == 0
    assert store.remove("tiny@v2") == ["tiny@v2"]
    assert store.models() == {"tiny": [1]}
    assert store.gc(grace_s=0)["removed"] > 0
    with store.reader("tiny") as r:
        assert r.state_dict()
    with pytest.raises(NotFound):
        store.remove("tiny@v7")


@pytest.mark.parametrize("name", ["a/b", "..", "x..y", "bad\x01name", "", "-lead", "a" * 200])
def test_bad_names_are_refused_before_writing(store, tiny_hf, name):
    with pytest.raises(InvalidRequest):
        store.import_model(tiny_hf[0], name)
    assert all(loc.list("") == [] for loc in store.locations)


def test_truncated_safetensors_refused_before_writing(store, tiny_hf, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf[0], bad)
    f = sorted(bad.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(InvalidRequest, match="truncated"):
        store.import_model(str(bad), "tiny")
    assert all(loc.list("") == [] for loc in store.locations)


def test_unsupported_architecture_refused(store, tiny_hf, tmp_path):
    import shutil

    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_hf[0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(InvalidRequest, match="unsupported architecture"):
        store.import_model(str(bad), "tiny")


@pytest.mark.parametrize("kw,match", [({"k": 0}, "k >= 1"), ({"m": -1}, "m >= 0"), ({"k": 200, "m": 57}, "256")])
def test_invalid_codec(kw, match):
    with pytest.raises(InvalidRequest, match=match):
        StoreConfig(locations=[f"memory://x/{i}" for i in range(6)], **kw)


def test_too_few_locations_refused_at_import(tiny_hf):
    cfg = StoreConfig(locations=[f"memory://few/{i}" for i in range(6)], k=8, m=3)
    with ParamStore(cfg) as store:
        with pytest.raises(InvalidRequest, match="at least 11"):
            store.import_model(tiny_hf[0], "tiny")
        assert all(loc.list("") == [] for loc in store.locations)


def test_unknown_model_and_version(store, tiny_hf):
    with pytest.raises(NotFound):
        store.manifest("nope")
    store.import_model(tiny_hf[0], "tiny")
    with pytest.raises(NotFound, match="versions: v1"):
        store.manifest("tiny@v3")


def test_local_backend_round_trip_and_layout(local_store_config, tiny_hf):
    with ParamStore(local_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny", dtype="fp32").manifest
        root = local_store_config.locations[0]
        assert os.path.isfile(os.path.join(root, "models", "tiny", "v000001.json"))
        frags = store.locations[0].list("shards")
        assert frags and all(".k4n6.f" in f for f in frags)
        with store.reader(m) as r:
            sd = r.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in tiny_hf[2].items())
