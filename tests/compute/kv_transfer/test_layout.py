"""Layout, pool geometry, config validation and the sender ledger (fake clock)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compute.kv_transfer import KVLayout, KVPool, TransferConfig
from compute.kv_transfer.layout import paired_runs, runs
from compute.kv_transfer.ledger import SenderLedger


def test_layout_sizes_and_round_trip():
    lay = KVLayout(30, 16, 3, 64, "bfloat16")  # SmolLM2-135M
    assert lay.dtype == torch.bfloat16 and lay.block_nbytes == 16 * 3 * 64 * 2
    assert lay.bytes_per_block_per_layer == 2 * lay.block_nbytes
    assert lay.bytes_per_block == 30 * 2 * lay.block_nbytes
    assert lay.num_blocks_for(512) == 32 and lay.num_blocks_for(513) == 33
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError):
        KVLayout(0, 16, 3, 64)
    with pytest.raises(ValueError):
        KVLayout(1, 16, 3, 64, "int4")


def test_pool_is_one_region_with_engine_views(layout):
    pool = KVPool.allocate(layout, 6)
    assert pool.k.shape == (3, 6, 4, 2, 8) and pool.k[1].is_contiguous()
    pool.k[2, 5].fill_(7.0)
    assert pool.tensor[2, 0, 5].eq(7).all()
    r = pool.region
    assert r.nbytes == pool.tensor.numel() * 4 and r.unit_nbytes == layout.block_nbytes
    # adjacent blocks merge within a (layer, kv); canonical order is (layer, kv, i)
    segs = r.segments([3, 4, 5, 0])
    assert len(segs) == 3 * 2 * 2 and segs[0] == (3 * layout.block_nbytes, 3 * layout.block_nbytes)


def test_pool_accepts_block_major_view_and_rejects_two_regions(layout):
    base = torch.zeros((6, 3, 2, 4, 2, 8))  # [NB, L, 2, BS, KVH, Dh]
    pool = KVPool(layout, base.permute(1, 2, 0, 3, 4, 5))
    assert pool.region.strides[2] == 3 * 2 * layout.block_nbytes
    assert len(pool.region.segments([2])) == 1  # every layer of one block is one run
    with pytest.raises(ValueError):
        KVPool(layout, torch.zeros(layout.shape(8))[:, :, :6])  # a slice: not its whole storage
    with pytest.raises(ValueError):
        KVPool(layout, torch.zeros(layout.shape(6)).transpose(4, 5).contiguous().transpose(4, 5))
    with pytest.raises(ValueError):
        KVPool(layout, torch.zeros(layout.shape(6), dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        KVPool.allocate(layout, 6).check_blocks([1, 1])


def test_runs_merge_only_when_both_sides_are_adjacent():
    assert runs(np.array([0, 10, 20, 50]), 10) == [(0, 30), (50, 10)]
    s, d, n = paired_runs(np.array([0, 10, 20]), np.array([100, 110, 300]), 10)
    assert s.tolist() == [0, 20] and d.tolist() == [100, 300] and n.tolist() == [20, 10]


def test_config_is_validated():
    TransferConfig()
    for bad in ({"backend": "rdma"}, {"port": 70000}, {"compression": "zstd"},
                {"hold_s": 1.0, "timeout_s": 2.0}, {"staging_blocks": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            TransferConfig(**bad)


def test_sender_ledger_tick_by_tick():
    now = [0.0]
    led = SenderLedger(hold_s=5.0, stream_s=2.0, clock=lambda: now[0])
    led.add("a", [1], 1, 4)
    led.add("b", [2], 1, 4)
    with pytest.raises(ValueError):
        led.add("a", [3], 1, 4)
    now[0] = 4.9
    assert led.expired() == []
    assert led.begin("b")[0] is not None  # b streams from t=4.9
    now[0] = 5.1
    assert led.expired() == ["a"]  # a streaming hold is not expired by hold_s...
    assert led.finish("a", "failed", "expired").reason == "expired"
    assert led.finish("a", "failed", "again") is None  # first call wins
    now[0] = 7.0
    assert led.expired() == ["b"]  # ...but by the stream safety net
    assert led.begin("a") == (None, "expired")
