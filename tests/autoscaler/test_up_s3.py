"""`pdserve up` serving from S3 (a real moto S3 server on 127.0.0.1) with one storage location gone.

A tiny Llama with SmolLM2's tokenizer bundle is imported into 6 S3 locations (4 data + 2 parity
fragments per shard); every object of the location that holds the first data fragment of the bundle
shard is deleted; then `pdserve up --both 1` starts on that store (gateway and node read the manifest,
the bundle and every weight shard from S3, the node's shard cache empty) and the real `openai` client
gets its answer. The node's own metrics show the reads were degraded (rebuilt from parity), and the
answer is the one the same service gives from a store that lost nothing.
"""

from __future__ import annotations

import os
import re
import time
import uuid

import httpx
import pytest

from compute.node.launcher import Services
from tests.conftest import tiny_llama_config, tiny_llama_tensors, write_hf_folder
from tests.paramstore.s3server import moto_url  # noqa: F401 - the module's moto server
from tests.procs import children, kill_left
from tests.services import AUTH, TOKEN, admin_headers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
openai = pytest.importorskip("openai")
MODEL = "tiny-s3"
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_chat_folder(tmp_path_factory, real_model_store):
    """An HF folder: a tiny random Llama with the real SmolLM2 tokenizer and chat template."""
    from paramstore import ParamStore, StoreConfig

    locations, name = real_model_store
    with ParamStore(StoreConfig(locations=locations)) as ps, ps.reader(ps.manifest(name)) as r:
        files = r.bundle()
    cfg = tiny_llama_config(vocab=49152, tied=True)
    folder = write_hf_folder(tmp_path_factory.mktemp("tiny-s3"), cfg, tiny_llama_tensors(cfg, seed=3), files=1)
    for fname, data in files.items():
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(data)
    return folder


def _s3_store(moto: str, folder: str):
    """A fresh bucket, the model imported into 6 locations (k=4, m=2): (StoreConfig, manifest, s3fs, opts)."""
    import s3fs

    from paramstore import ParamStore, StoreConfig

    opts = {"key": "testing", "secret": "testing", "endpoint_url": moto}
    bucket = f"pdserve-up-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **opts)
    fs.mkdir(bucket)
    cfg = StoreConfig(locations=[f"s3://{bucket}/loc{i}" for i in range(6)], k=4, m=2, shard_bytes=256 * 1024,
                      storage_options={"s3": opts})  # fmt: skip
    with ParamStore(cfg) as ps:
        manifest = ps.import_model(folder, MODEL).manifest
    return cfg, manifest, fs, opts


def _answer_from_up(tmp, cfg, opts: dict) -> tuple[str, float, dict]:
    """`pdserve up --both 1` on the store `cfg`: (greedy answer of 8 tokens, seconds to it, the node's /metrics
    counters of the store). Everything it started is stopped."""
    os.makedirs(tmp / "logs", exist_ok=True)
    conf = tmp / "pdserve.toml"
    s3 = ", ".join(f'{k} = "{v}"' for k, v in opts.items())
    conf.write_text(f"[store]\nlocations = {cfg.locations!r}\n[store.storage_options]\ns3 = {{{s3}}}\n"
                    '[node]\nkernels = "fixed"\n')  # no kernel timing: both runs compute alike  # fmt: skip
    services = Services([], MODEL, str(tmp), TOKEN, env={"PDSERVE_CACHE_DIR": str(tmp / "cache")})  # cache empty
    up = services.start("up", ["up", "--both", "1", "--config", str(conf), "--log-dir", str(tmp / "logs")])
    seen: dict[int, str] = {}
    try:
        t0 = time.monotonic()

        def placed():
            seen.update(children(up.p.pid))
            assert up.p.poll() is None, up.log()[-3000:]
            try:
                nodes = httpx.get(up.url + "/admin/status", headers=admin_headers(up.url), timeout=5).json()["nodes"]
            except (httpx.HTTPError, ValueError, KeyError):  # KeyError: a 401 before `up` wrote its admin key
                return None
            return next((n for n in nodes if n["models"].get(MODEL) == "ready"), None)

        node = wait_for(placed, 240, f"{MODEL} ready on the node of pdserve up")
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        took = time.monotonic() - t0
        assert r.model == MODEL and r.usage.completion_tokens == 8 and r.choices[0].message.content, r
        metrics = httpx.get(node["url"] + "/metrics", auth=AUTH, timeout=10).text
        counters = {name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))
                    for name in ("paramstore_degraded_reads_total", "paramstore_cache_misses_total")}  # fmt: skip
        seen.update(children(up.p.pid))
        return r.choices[0].message.content, took, counters
    finally:
        try:
            up.stop()
        finally:
            kill_left(seen)


def test_pdserve_up_on_s3_answers_with_one_location_deleted(moto_url, tiny_chat_folder, tmp_path):  # noqa: F811
    cfg, manifest, fs, opts = _s3_store(moto_url, tiny_chat_folder)
    whole, _, counters = _answer_from_up(tmp_path / "whole", cfg, opts)
    assert counters["paramstore_degraded_reads_total"] == 0 and counters["paramstore_cache_misses_total"] > 0

    def lost(loc: int) -> list[str]:  # the weight shards whose data fragment `loc` holds
        return [s.name for s in manifest.weight_shards() if any(f.location == loc and f.index < manifest.k
                                                                for f in s.fragments)]  # fmt: skip

    gone = max(range(len(cfg.locations)), key=lambda i: len(lost(i)))  # the most reads to rebuild
    path = cfg.locations[gone].removeprefix("s3://")
    deleted = fs.find(path)
    fs.rm(path, recursive=True)
    assert lost(gone) and deleted and not fs.find(path)
    answer, took, counters = _answer_from_up(tmp_path / "degraded", cfg, opts)
    assert answer == whole  # rebuilt from parity: the same weights, the same greedy answer
    assert counters["paramstore_degraded_reads_total"] >= len(lost(gone)), (counters, lost(gone))
    print(f"s3 with location {gone} deleted ({len(deleted)} objects; data fragments of {len(lost(gone))} of "
          f"{len(manifest.weight_shards())} weight shards): answered in {took:.1f} s from the start of pdserve up")
