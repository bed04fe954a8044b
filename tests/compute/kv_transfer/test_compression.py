"""Wire codecs: error bounds, bytes on the wire, and a compressed transfer end to end."""

from __future__ import annotations

import pytest
import torch

from compute.kv_transfer import (
    CODECS,
    KVLayout,
    KVPool,
    get_codec,
    make_transfer,
    metrics,
    wait,
)

SMOL = KVLayout(30, 16, 3, 64)


def _kv(layout, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((layout.num_layers, 2, n, layout.block_size, layout.n_kv_heads, layout.head_dim), generator=g)
    return (x * 3).to(layout.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bounds(dtype):
    lay = KVLayout(2, 16, 3, 64, dtype)
    x = _kv(lay)
    xf = x.float()
    for name, rel in (("none", 0.0), ("bf16", 2**-8), ("fp16", 2**-11)):
        y = CODECS[name].decode(CODECS[name].encode(x), lay)
        assert y.dtype == dtype and y.shape == x.shape
        bound = 0.0 if dtype == torch.bfloat16 else rel  # nothing to shrink in a bf16 cache
        assert ((y.float() - xf).abs() <= xf.abs() * bound).all(), name
    y = CODECS["int8"].decode(CODECS["int8"].encode(x), lay).float()
    ch = xf.abs().amax(-3, keepdim=True).half().float()  # per-(head, channel) smoothing factors
    bound = ch * (xf / ch).abs().amax(-1, keepdim=True) / 254
    slack = xf.abs().amax(-1, keepdim=True) * (2**-8 if dtype == torch.bfloat16 else 1e-5)  # bf16/fp16 rounding
    assert ((y - xf).abs() <= bound + slack).all()
    assert ((y - xf).abs().mean() / xf.abs().mean()) < 0.01


def test_bytes_on_wire_ratios():
    assert get_codec("bf16").ratio(SMOL) == 2.0 and get_codec("fp16").ratio(SMOL) == 2.0
    # per (token, head): 64 fp32 -> 64 int8 + one fp32 scale; per block unit: + KVH*Dh fp16 channel factors
    assert get_codec("int8").ratio(SMOL) == pytest.approx(12288 / 3648)
    bf = KVLayout(30, 16, 3, 64, torch.bfloat16)
    assert get_codec("bf16").ratio(bf) == 1.0 and get_codec("int8").ratio(bf) == pytest.approx(6144 / 3648)
    zeros = torch.zeros((1, 2, 1, 16, 3, 64))
    assert CODECS["int8"].decode(CODECS["int8"].encode(zeros), SMOL).eq(0).all()  # absmax 0: no NaN
    with pytest.raises(ValueError):
        get_codec("zstd")


@pytest.mark.parametrize("backend", ["tcp", "fake"])
def test_compressed_transfer_reports_bytes_saved(backend):
    lay = KVLayout(4, 16, 3, 64)
    src, dst = KVPool.allocate(lay, 8), KVPool.allocate(lay, 8)
    src.tensor.copy_(_kv(lay, 8))
    saved0 = metrics.SAVED.labels(backend)._value.get()
    with make_transfer(backend, "prefill", lay, src, compression="int8") as s, \
            make_transfer(backend, "decode", lay, dst) as r:  # fmt: skip
        h = s.offer("c1", [1, 2, 6], 40)
        tid = r.start(h, [7, 0, 3])
        assert wait(r.poll, tid, 10).value == "done"
        st = r.stats(tid)
        assert st.nbytes == 3 * lay.bytes_per_block and st.nbytes / st.wire_nbytes == pytest.approx(12288 / 3648)
        assert st.saved_nbytes == st.nbytes - st.wire_nbytes
        assert metrics.SAVED.labels(backend)._value.get() - saved0 == st.saved_nbytes
        err = (dst.gather([7, 0, 3]) - src.gather([1, 2, 6])).abs()
        want = CODECS["int8"].decode(CODECS["int8"].encode(src.gather([1, 2, 6])), lay)  # the codec's own round trip
        assert torch.equal(dst.gather([7, 0, 3]), want) and err.max() < 0.1
        assert wait(s.poll, "c1", 5).value == "done"
