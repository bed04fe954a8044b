"""The S3 path end to end against a real moto S3 server on 127.0.0.1 (s3fs underneath)."""

from __future__ import annotations

import uuid

import pytest
import torch

from paramstore import ParamStore, ReaderConfig, StoreConfig

from .damage import flip_bit, lose
from .s3server import moto_url  # noqa: F401 - a fixture, found by name

pytestmark = pytest.mark.slow


@pytest.fixture
def s3_config(moto_url):  # noqa: F811
    import s3fs

    opts = {"key": "testing", "secret": "testing", "endpoint_url": moto_url}
    bucket = f"pdserve-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **opts).mkdir(bucket)
    locations = [f"s3://{bucket}/loc{i}" for i in range(6)]
    return StoreConfig(locations=locations, k=4, m=2, shard_bytes=64 * 1024, storage_options={"s3": opts})


def test_s3_import_read_degrade_repair(s3_config, tiny_hf):
    folder, _, tensors = tiny_hf
    with ParamStore(s3_config) as store:
        m = store.import_model(folder, "tiny", dtype="fp32").manifest
        assert store.models() == {"tiny": [1]}
        with store.reader("tiny") as r:
            sd = r.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in tensors.items())
        for s in m.shards:
            lose(store, m, s, (0,))
        flip_bit(store, m, m.shards[1], 3)
        with store.reader("tiny", ReaderConfig(verify_digest="always")) as r:
            sd = r.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in tensors.items())
        report = store.verify("tiny", deep=True)
        assert {h.status for h in report} == {"degraded"}
        store.repair("tiny")
        assert {h.status for h in store.verify("tiny", deep=True)} == {"ok"}


def test_s3_publish_is_exclusive(s3_config, tiny_hf):
    with ParamStore(s3_config) as store:
        loc = store.locations[0]
        assert loc.put_exclusive("models/x/v000001.json", b"first") is True
        assert loc.put_exclusive("models/x/v000001.json", b"second") is False
        assert loc.get("models/x/v000001.json") == b"first"
        store.import_model(tiny_hf[0], "tiny")
        store.import_model(tiny_hf[0], "tiny")
        assert store.models()["tiny"] == [1, 2]
