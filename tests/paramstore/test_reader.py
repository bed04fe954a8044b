"""Reader behaviour beyond round trips: hedged reads around a slow location, prefetch order, metrics."""

from __future__ import annotations

import time

import torch
from prometheus_client import REGISTRY

from paramstore import ParamStore, ReaderConfig


class SlowTwin:
    """A named fake beside a real location: the same object, but every read stalls first (or finds nothing)."""

    def __init__(self, inner, delay: float, gone: bool = False):
        self.inner, self.delay, self.gone, self.url = inner, delay, gone, inner.url

    def readinto(self, rel, buf):
        time.sleep(self.delay)
        if self.gone:
            raise FileNotFoundError(rel)
        return self.inner.readinto(rel, buf)


def test_slow_data_fragment_is_raced_by_parity(memory_store_config, tiny_hf):
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny", dtype="fp32").manifest
        shard = m.shards[1]
        with store.reader(m) as r:
            want = r.read(shard).tensors()[0]
        cfg = ReaderConfig(hedge_s=0.05, verify_digest="always")
        slow = shard.fragments[0].location
        with store.reader(m, cfg) as r:  # the control, in this run: fragment 0 gone, rebuilt from parity
            r.locations[slow] = SlowTwin(r.locations[slow], delay=0.0, gone=True)
            t0 = time.perf_counter()
            assert r.read(shard).degraded == 1
            control_s = time.perf_counter() - t0
        delay = 1.0 + 20 * control_s  # a stall long against anything a read takes on this machine
        with store.reader(m, cfg) as r:
            r.locations[slow] = SlowTwin(r.locations[slow], delay=delay)
            t0 = time.perf_counter()
            read = r.read(shard)
            took = time.perf_counter() - t0
            got = read.tensors()[0]
        assert read.degraded == 1  # fragment 0 was rebuilt from parity instead of waited for
        assert took < delay / 2, (took, control_s)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_stalled_read_neither_holds_the_close_nor_writes_after_its_shard(memory_store_config, tiny_hf):
    """A data fragment's read stalls past the hedge (a location that hangs): the shard is rebuilt from parity, the
    same buffer is reused for the next shard, the reader is closed without waiting for the stalled read, and when it
    ends, late, nothing of it lands in the buffer that now holds the next shard."""
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny", dtype="fp32").manifest
        a, b = m.shards[1], m.shards[2]
        with store.reader(m) as r:
            want = bytes(r.read(b).buffer)
        buf = bytearray(m.k * max(a.fragment_size, b.fragment_size))
        slow = a.fragments[0].location
        r = store.reader(m, ReaderConfig(hedge_s=0.05))
        real = r.locations[slow]
        r.locations[slow] = SlowTwin(real, delay=1.5)
        t0 = time.perf_counter()
        assert r.read(a, buf).degraded == 1
        r.locations[slow] = real  # b reads everything, into the same buffer
        got = bytes(r.read(b, buf).buffer)
        r.close()
        closed_s = time.perf_counter() - t0
        time.sleep(2.0)  # a's stalled fragment read ends now
        assert closed_s < 1.2, closed_s
        assert got == want and bytes(buf[: len(want)]) == want


def test_iter_shards_yields_load_order_with_prefetch(memory_store_config, tiny_hf):
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny").manifest
        with store.reader(m, ReaderConfig(prefetch=3)) as r:
            order = [s.shard.index for s in r.iter_shards()]
        assert order == [s.index for s in m.weight_shards()]
        kinds = [m.shards[i].kind for i in order]
        assert kinds[0] == "embed" and kinds[-1] == "head"


def _value(name, labels=None):
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_metrics_count_loads_bytes_and_degraded_reads(memory_store_config, tiny_hf):
    with ParamStore(memory_store_config) as store:
        m = store.import_model(tiny_hf[0], "tiny").manifest
        loads0 = _value("paramstore_shard_load_seconds_count")
        degraded0 = _value("paramstore_degraded_reads_total")
        loc = m.locations[m.shards[1].fragments[0].location]
        bytes0 = _value("paramstore_bytes_read_total", {"location": loc})
        store.location(loc).remove(m.shards[1].fragment_path(m.k, m.n, 0))
        with store.reader(m) as r:
            r.state_dict()
        assert _value("paramstore_shard_load_seconds_count") - loads0 == len(m.weight_shards())
        assert _value("paramstore_degraded_reads_total") - degraded0 == 1
        assert _value("paramstore_bytes_read_total", {"location": loc}) > bytes0
