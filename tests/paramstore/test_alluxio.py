"""alluxio+<ufs>:// locations through alluxiofs in pass-through mode (no Alluxio cluster exists here).

This proves our calls go through alluxiofs' fsspec surface to the under-store;
it does not exercise Alluxio workers (see docs/paramstore.md: Locations, Alluxio).
"""

from __future__ import annotations

import pytest
import torch

from paramstore import ParamStore, StoreConfig

from .damage import lose


def test_alluxio_pass_through_round_trip(tmp_path, tiny_hf):
    pytest.importorskip("alluxiofs")
    locations = [f"alluxio+file://{tmp_path}/loc{i}" for i in range(6)]
    cfg = StoreConfig(locations=locations, k=4, m=2, shard_bytes=64 * 1024,
                      storage_options={"alluxio": {"skip_alluxio": True}})  # fmt: skip
    folder, _, tensors = tiny_hf
    with ParamStore(cfg) as store:
        m = store.import_model(folder, "tiny", dtype="fp32").manifest
        assert (tmp_path / "loc0" / "models" / "tiny" / "v000001.json").is_file()  # landed in the under-store
        lose(store, m, m.shards[1], (1, 4))
        with store.reader("tiny") as r:
            sd = r.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in tensors.items())
        assert store.verify("tiny")[1].status == "degraded"
