"""Where a node's kernel plan comes from (compute/kernels/plans.py): the store's plan first, the machine's cache
next, the rule otherwise; a bad plan from the store is ignored with one log line; the background measurement
runs once per machine (the lock), paces itself while the engine is busy, saves and publishes its table.

Tiny shapes only: a measurement of them takes a second or two."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from compute.kernels import int8, plans
from paramstore import ParamStore, StoreConfig

SHAPES = [(64, 64), (128, 64)]


@pytest.fixture
def store(tmp_path):
    with ParamStore(StoreConfig([str(tmp_path / f"loc{i}") for i in range(3)], k=2, m=1)) as s:
        yield s


@pytest.fixture(scope="module")
def measured():
    return int8.measure(SHAPES, 1, repeats=1)


def test_the_store_first_then_the_machine_then_nothing(tmp_path, store, measured):
    cache = str(tmp_path / "int8.json")
    assert plans.lookup(SHAPES, 1, cache, store) == (None, "")
    int8.save_table(cache, measured)
    table, source = plans.lookup(SHAPES, 1, cache, store)
    assert source == "local" and table["shapes"] == measured["shapes"]
    store.plans.publish(measured["key"], {**measured, "shapes": {"64x64": measured["shapes"]["64x64"]}})
    assert plans.lookup(SHAPES, 1, cache, store)[1] == "local"  # the store's lacks a shape: not taken
    assert plans.publish(store, measured, 1)
    assert plans.lookup(SHAPES, 1, cache, store)[1] == "store"
    assert plans.lookup(SHAPES, 2, cache, store) == (None, "")  # 2 threads: another machine class


@pytest.mark.parametrize("damage", ["corrupt", "other torch", "unsigned", "malformed"])
def test_a_bad_plan_in_the_store_is_ignored_with_one_line(tmp_path, measured, damage, caplog):
    locs = [str(tmp_path / f"loc{i}") for i in range(3)]
    key = b"k" * 32 if damage == "unsigned" else None
    with ParamStore(StoreConfig(locs, k=2, m=1)) as writer:
        table = dict(measured)
        if damage == "other torch":
            table["key"] = measured["key"].replace("|torch ", "|torch 0.0+")  # the same id, another torch
        if damage == "malformed":
            table["shapes"] = {"64x64": {"choice": ["magic"] * 4}, "128x64": measured["shapes"]["128x64"]}
        writer.plans.publish(measured["key"], table)
        if damage == "corrupt":
            for loc in locs:
                with open(f"{loc}/plans/{measured['key'][:16]}.json", "r+b") as f:
                    f.seek(40)
                    f.write(b"#")
    with ParamStore(StoreConfig(locs, k=2, m=1, hmac_key=key)) as reader:
        with caplog.at_level(logging.WARNING, logger="pdserve.node"):
            assert plans.lookup(SHAPES, 1, None, reader) == (None, "")
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1, lines


def test_two_measurements_on_one_machine_measure_once(tmp_path, store):
    """The second waits on the lock and takes the first's table from the cache ("peer"); the store gets it."""
    cache, got = str(tmp_path / "int8.json"), {}
    plans.stop_all()  # an earlier test's model may still measure in this process: the counter is per process
    before = plans.SHAPES_MEASURED._value.get()
    ms = [plans.BackgroundMeasure(SHAPES, 1, cache, store, lambda t, s, i=i: got.__setitem__(i, s),
                                         poll_s=0.05) for i in range(2)]  # fmt: skip
    for m in ms:
        m.start()
    assert all(m.wait(120) for m in ms)
    assert sorted(got.values()) == ["measured", "peer"] and all(m.state == "done" for m in ms)
    assert plans.SHAPES_MEASURED._value.get() - before == len(SHAPES)
    assert plans.lookup(SHAPES, 1, None, store)[1] == "store"  # published by the one that measured
    assert set(json.load(open(cache))["tables"]) == {int8.machine_key(1)}


def test_while_the_engine_is_busy_it_takes_at_most_its_share(tmp_path):
    done = threading.Event()
    m = plans.BackgroundMeasure(SHAPES, 1, None, None, lambda t, s: done.set(), busy=lambda: True, share=0.25)
    t0 = plans.time.perf_counter()
    m.start()
    assert m.wait(300) and done.is_set()
    wall = plans.time.perf_counter() - t0
    assert wall >= 0.9 * m.measured_s / 0.25  # it slept 3 s for every 1 s of work


def test_stopped_before_the_end_applies_nothing(tmp_path):
    applied = []
    m = plans.BackgroundMeasure(SHAPES, 1, str(tmp_path / "k.json"), None, lambda t, s: applied.append(s),
                                       busy=lambda: True, share=0.01)  # fmt: skip
    m.start()
    assert m.stop(30) and m.state == "stopped" and applied == []
