"""Node-local shard cache: the LRU-K policy tick by tick, tier budgets, corruption, 4 processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import time

import pytest
import xxhash
from prometheus_client import REGISTRY

from paramstore.cache import CacheConfig, LruK, NodeCache, check_key
from paramstore.errors import IntegrityError, InvalidRequest

MiB = 1 << 20


def blob(seed: int, size: int) -> tuple[str, bytes]:
    """Deterministic bytes and their content address (xxh3-128 hex)."""
    data = random.Random(seed).randbytes(size)
    return xxhash.xxh3_128_hexdigest(data), data


def verifier(key: str):
    return lambda view: xxhash.xxh3_128_hexdigest(view) == key


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class Fetcher:
    """A fetch that counts its calls."""

    def __init__(self, data: bytes):
        self.data, self.calls = data, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


# --- LRU-K policy, tick by tick --------------------------------------------------------------


def test_lruk_k2_scan_does_not_evict_twice_accessed_key():
    p, sizes, budget = LruK(2), {}, 3
    for t, key in enumerate(["hot", "hot"]):
        p.touch(key, t)
        sizes[key] = 1
    evicted = []
    for t, key in enumerate([f"scan{i}" for i in range(10)], start=10):
        p.touch(key, t)
        sizes[key] = 1
        for v in p.victims(sizes, budget, protect=(key,)):
            evicted.append(v)
            del sizes[v]
            p.remove(v)
    assert "hot" in sizes and "hot" not in evicted
    assert evicted == [f"scan{i}" for i in range(8)]  # one-shot keys go first, oldest first


def test_lruk_k2_scripted_victim_order():
    p = LruK(2)
    script = [("a", 1), ("b", 2), ("c", 3), ("a", 4), ("b", 5), ("d", 6), ("c", 7), ("a", 8), ("e", 9)]
    for key, t in script:
        p.touch(key, t)
    # 2nd most recent access: a=4, b=2, c=3; d and e have one access (infinite distance), d older.
    assert p.order("abcde") == ["d", "e", "b", "c", "a"]
    sizes = dict.fromkeys("abcde", 10)
    assert p.victims(sizes, budget=50) == []
    assert p.victims(sizes, budget=30) == ["d", "e"]
    assert p.victims(sizes, budget=25, protect=("e",)) == ["d", "b", "c"]
    p.touch("b", 10)  # b: history (5, 10) -> 2nd most recent is 5, now the youngest
    assert p.order("abc") == ["c", "a", "b"]
    p.remove("a")
    assert p.order("abc") == ["a", "c", "b"]  # forgotten: no history, goes first
    assert p.history("b") == [5, 10]


def test_lruk_k3_scan_resistance_and_order():
    p = LruK(3)
    for t, key in enumerate(["x", "y", "x", "y", "x", "z", "z", "z", "w", "w"]):
        p.touch(key, t)
    # 3rd most recent: x=0, z=5; y and w have < 3 accesses: y (last 3) before w (last 9).
    assert p.order("wxyz") == ["y", "w", "x", "z"]
    sizes = dict.fromkeys("wxyz", 1)
    for t in range(20, 30):  # a scan of one-shot keys through a budget of 4
        key = f"s{t}"
        p.touch(key, t)
        sizes[key] = 1
        for v in p.victims(sizes, 4, protect=(key,)):
            del sizes[v]
            p.remove(v)
    assert {"x", "z"} <= set(sizes)  # three-times-accessed keys survive the scan
    assert len(sizes) == 4


def test_lruk_clock_going_backwards_is_clamped():
    p = LruK(2)
    p.touch("a", 10)
    p.touch("a", 5)
    assert p.history("a") == [10, 10]


# --- config and keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dir="", disk_bytes=0, memory_bytes=0, k=0),
        dict(dir="", disk_bytes=-1, memory_bytes=0),
        dict(dir="", disk_bytes=0, memory_bytes=-5),
        dict(dir="", disk_bytes=10, memory_bytes=0),
        dict(dir="x", disk_bytes=0, memory_bytes=0, k=2.5),
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(InvalidRequest):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("key", ["", "../etc", "a/b", ".hidden", "..", "a\x00b", "x" * 201, "é", 5])
def test_bad_keys_rejected(tmp_path, key):
    with pytest.raises(InvalidRequest):
        check_key(key)
    cache = NodeCache(CacheConfig(str(tmp_path), disk_bytes=MiB, memory_bytes=MiB))
    with pytest.raises(InvalidRequest):
        cache.get_or_fetch(key, 1, lambda: b"x", lambda v: True)
    assert os.listdir(tmp_path / "objects") == []


# --- tiers and budgets -----------------------------------------------------------------------


def test_memory_tier_budget_and_oversize(tmp_path):
    clock = FakeClock()
    cache = NodeCache(CacheConfig("", disk_bytes=0, memory_bytes=3 * MiB, clock=clock))
    blobs = [blob(i, MiB) for i in range(6)]
    hot_key, hot = blobs[0]
    for _ in range(2):
        assert cache.get_or_fetch(hot_key, MiB, lambda: hot, verifier(hot_key)) == hot
    for key, data in blobs[1:]:
        view = cache.get_or_fetch(key, MiB, Fetcher(data), verifier(key))
        assert bytes(view) == data
        assert cache.stats()["bytes_memory"] <= 3 * MiB
    assert cache.contains(hot_key)  # accessed twice: survives the one-shot stream
    assert cache.contains(blobs[-1][0]) and not cache.contains(blobs[1][0])
    big_key, big = blob(99, 4 * MiB)
    f = Fetcher(big)
    assert bytes(cache.get_or_fetch(big_key, 4 * MiB, f, verifier(big_key))) == big
    assert not cache.contains(big_key) and f.calls == 1  # served, not kept
    s = cache.stats()
    assert s["hits_memory"] == 1 and s["fetches"] == 7 and s["evictions_memory"] == 3
    assert s["entries_memory"] == 3


def test_disk_tier_budget_lru_k_and_shared_history(tmp_path):
    clock = FakeClock()
    cfg = CacheConfig(str(tmp_path), disk_bytes=3 * MiB, memory_bytes=0, clock=clock)
    a, b = NodeCache(cfg), NodeCache(cfg)  # two instances = two processes' view of one dir
    blobs = [blob(i, MiB) for i in range(6)]
    hot_key, hot = blobs[0]
    f = Fetcher(hot)
    a.get_or_fetch(hot_key, MiB, f, verifier(hot_key))
    assert bytes(b.get_or_fetch(hot_key, MiB, f, verifier(hot_key))) == hot  # b hits a's file
    assert f.calls == 1 and b.stats()["hits_disk"] == 1
    for key, data in blobs[1:]:
        b.get_or_fetch(key, MiB, Fetcher(data), verifier(key))
        on_disk = sum(p.stat().st_size for p in (tmp_path / "objects").rglob("*") if p.is_file())
        assert on_disk <= 3 * MiB
    assert a.contains(hot_key)  # history recorded by a and b together protects it
    assert [a.contains(k) for k, _ in blobs[1:]] == [False, False, False, True, True]
    assert b.stats()["evictions_disk"] == 3 and b.stats()["bytes_disk"] == 3 * MiB
    assert os.listdir(tmp_path / "locks") == []  # lock files are removed by their holders
    big_key, big = blob(98, 4 * MiB)
    assert bytes(a.get_or_fetch(big_key, 4 * MiB, lambda: big, verifier(big_key))) == big
    assert not a.contains(big_key)  # larger than the disk budget: served, not stored
    a.clear()
    assert a.stats()["entries_disk"] == 0 and not b.contains(hot_key)


def test_k3_through_the_disk_tier(tmp_path):
    cache = NodeCache(CacheConfig(str(tmp_path), disk_bytes=3 * MiB, memory_bytes=0, k=3, clock=FakeClock()))
    (a, da), (b, db), *scan = [blob(200 + i, MiB) for i in range(5)]
    for _ in range(3):
        cache.get_or_fetch(a, MiB, lambda: da, verifier(a))  # 1 fill + 2 disk hits = 3 accesses
    for _ in range(2):
        cache.get_or_fetch(b, MiB, lambda: db, verifier(b))  # 2 accesses: still infinite K-distance
    for key, data in scan:
        cache.get_or_fetch(key, MiB, lambda d=data: d, verifier(key))
    assert [cache.contains(k) for k in (a, b, scan[0][0], scan[1][0], scan[2][0])] == [True, False, False, True, True]
    doc = json.loads((tmp_path / "index.json").read_text())
    assert len(doc["entries"][a][1]) == 3 and doc["k"] == 3


def test_disk_hit_promotes_to_memory_and_metrics(tmp_path):
    key, data = blob(1, MiB)
    cfg = CacheConfig(str(tmp_path), disk_bytes=4 * MiB, memory_bytes=4 * MiB)
    NodeCache(cfg).get_or_fetch(key, MiB, lambda: data, verifier(key))
    before = {t: REGISTRY.get_sample_value("paramstore_cache_hits_total", {"tier": t}) or 0 for t in ("memory", "disk")}
    cache = NodeCache(cfg)  # fresh process view: memory empty, disk warm
    assert bytes(cache.get(key, verifier(key))) == data
    assert bytes(cache.get(key)) == data
    s = cache.stats()
    assert (s["hits_disk"], s["hits_memory"], s["fetches"]) == (1, 1, 0)
    after = {t: REGISTRY.get_sample_value("paramstore_cache_hits_total", {"tier": t}) for t in ("memory", "disk")}
    assert after["disk"] - before["disk"] == 1 and after["memory"] - before["memory"] == 1
    assert cache.get(blob(2, 10)[0]) is None and cache.stats()["misses"] == 1


def test_index_rebuilt_when_lost_or_garbled(tmp_path):
    cfg = CacheConfig(str(tmp_path), disk_bytes=2 * MiB, memory_bytes=0, clock=FakeClock())
    cache = NodeCache(cfg)
    keys = []
    for i in range(2):
        key, data = blob(i, MiB)
        cache.get_or_fetch(key, MiB, lambda d=data: d, verifier(key))
        keys.append(key)
    (tmp_path / "index.json").write_text("{not json")
    cache2 = NodeCache(cfg)
    assert cache2.stats()["entries_disk"] == 2
    doc = json.loads((tmp_path / "index.json").read_text())
    assert sorted(doc["entries"]) == sorted(keys)
    key, data = blob(5, MiB)
    cache2.get_or_fetch(key, MiB, lambda: data, verifier(key))
    assert cache2.stats()["bytes_disk"] == 2 * MiB


# --- corruption ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_disk_entry_is_refetched(tmp_path, damage):
    key, data = blob(7, MiB)
    cfg = CacheConfig(str(tmp_path), disk_bytes=4 * MiB, memory_bytes=0)
    NodeCache(cfg).get_or_fetch(key, MiB, lambda: data, verifier(key))
    path = tmp_path / "objects" / key[:2] / key
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[12345] ^= 0xFF
    else:
        del raw[-100:]
    path.write_bytes(raw)
    cache = NodeCache(cfg)
    f = Fetcher(data)
    view = cache.get_or_fetch(key, MiB, f, verifier(key))
    assert xxhash.xxh3_128_hexdigest(view) == key and f.calls == 1
    assert path.read_bytes() == data  # repaired on disk
    s = cache.stats()
    assert s["corrupt"] == 1 and s["fetches"] == 1
    assert bytes(cache.get_or_fetch(key, MiB, f, verifier(key))) == data and f.calls == 1


def test_get_with_verify_deletes_corrupt_file(tmp_path):
    key, data = blob(8, 1000)
    cfg = CacheConfig(str(tmp_path), disk_bytes=MiB, memory_bytes=0)
    cache = NodeCache(cfg)
    cache.get_or_fetch(key, 1000, lambda: data, verifier(key))
    path = tmp_path / "objects" / key[:2] / key
    path.write_bytes(b"x" * 1000)
    assert cache.get(key, verifier(key)) is None
    assert not path.exists() and cache.stats()["corrupt"] == 1


def test_fetched_bytes_failing_verify_are_not_cached(tmp_path):
    key, data = blob(9, 1000)
    cache = NodeCache(CacheConfig(str(tmp_path), disk_bytes=MiB, memory_bytes=MiB))
    with pytest.raises(IntegrityError):
        cache.get_or_fetch(key, 1000, lambda: b"y" * 1000, verifier(key))
    with pytest.raises(IntegrityError):
        cache.get_or_fetch(key, 1000, lambda: data[:999], verifier(key))
    assert not cache.contains(key) and os.listdir(tmp_path / "locks") == []
    assert bytes(cache.get_or_fetch(key, 1000, lambda: data, verifier(key))) == data


def test_threads_of_one_process_share_one_fetch(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    key, data = blob(11, MiB)
    cache = NodeCache(CacheConfig(str(tmp_path), disk_bytes=4 * MiB, memory_bytes=4 * MiB))
    calls = []

    def fetch():
        calls.append(1)
        time.sleep(0.2)
        return data

    with ThreadPoolExecutor(4) as pool:
        views = list(pool.map(lambda _: cache.get_or_fetch(key, MiB, fetch, verifier(key)), range(4)))
    assert len(calls) == 1 and all(bytes(v) == data for v in views)


# --- several processes -----------------------------------------------------------------------


def _worker(root: str, phases: list, delay: float, barrier, results) -> None:
    """Per phase: wait for all, then read (seed, size) blobs through one cache dir; the fetch
    sleeps and logs one line per call to the phase's counter file."""
    cache = NodeCache(CacheConfig(root, disk_bytes=64 * MiB, memory_bytes=16 * MiB))
    for phase, (counter, keys) in enumerate(phases):
        barrier.wait(timeout=60)
        t0, digests, before = time.monotonic(), {}, cache.stats()
        for seed, size in keys:
            key, data = blob(seed, size)

            def fetch(key=key, data=data, counter=counter):
                with open(counter, "a") as f:
                    f.write(key + "\n")
                time.sleep(delay)
                return data

            digests[key] = xxhash.xxh3_128_hexdigest(cache.get_or_fetch(key, size, fetch, verifier(key)))
        hits = cache.stats()["hits_disk"] - before["hits_disk"]
        results.put((phase, os.getpid(), digests, time.monotonic() - t0, hits))


FETCH_S = 0.5  # each fetch sleeps this long
SAME_KEY = (42, 8 * MiB)
DIFFERENT = [(100 + i, (i + 1) * MiB) for i in range(4)]


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """Spawn 4 processes once; phase 0: all read SAME_KEY; phase 1: each starts on another of DIFFERENT."""
    tmp = tmp_path_factory.mktemp("procs")
    ctx = mp.get_context("spawn")
    barrier, results, n = ctx.Barrier(4), ctx.Queue(), 4
    counters = [str(tmp / "fetches0.log"), str(tmp / "fetches1.log")]
    procs = []
    for i in range(n):
        phases = [(counters[0], [SAME_KEY]), (counters[1], DIFFERENT[i:] + DIFFERENT[:i])]
        procs.append(ctx.Process(target=_worker, args=(str(tmp / "cache"), phases, FETCH_S, barrier, results)))
    for p in procs:
        p.start()
    try:
        out = [results.get(timeout=90) for _ in range(2 * n)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * n
    fetched = []
    for c in counters:
        with open(c) as f:
            fetched.append(f.read().split())
    return [[r[2:] for r in out if r[0] == phase] for phase in (0, 1)], fetched


@pytest.mark.slow
def test_four_processes_one_uncached_key_fetch_once(four_processes):
    rows, fetched = (x[0] for x in four_processes)
    key = blob(*SAME_KEY)[0]
    assert fetched == [key]  # exactly one fetch across 4 processes
    assert [digests[key] for digests, _, _ in rows] == [key] * 4  # identical, correct bytes everywhere
    assert sorted(hits for _, _, hits in rows) == [0, 1, 1, 1]


@pytest.mark.slow
def test_four_processes_different_keys_in_parallel(four_processes):
    rows, fetched = (x[1] for x in four_processes)
    keys = [blob(seed, size)[0] for seed, size in DIFFERENT]
    assert sorted(fetched) == sorted(keys)  # each key fetched once
    for digests, _, _ in rows:
        assert digests == {k: k for k in keys}
    # Fetches of different keys overlap: serialised, the slowest process would wait for all 4 fetches of
    # FETCH_S each. The control, in this run: phase 0, where every process waited for exactly one fetch
    # (of a bigger blob), start-up skew and hashing included.
    one_fetch = max(elapsed for _, elapsed, _ in four_processes[0][0])
    assert max(elapsed for _, elapsed, _ in rows) < one_fetch + 2 * FETCH_S, (rows, one_fetch)
