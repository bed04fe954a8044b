"""Popularity tracker: decay by half-life, ranking, atomic save/load."""

from __future__ import annotations

import json
import os

import pytest

from paramstore.errors import InvalidRequest
from paramstore.popularity import PopularityConfig, PopularityTracker


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tracker(half_life: float = 60.0, clock: FakeClock | None = None) -> PopularityTracker:
    return PopularityTracker(PopularityConfig(half_life_s=half_life, clock=clock or FakeClock()))


def test_score_halves_after_one_half_life():
    clock = FakeClock()
    t = tracker(60.0, clock)
    assert t.record("m", "s0") == 1.0
    assert t.record("m", "s0", now=1000.0, weight=3.0) == 4.0
    clock.t += 60.0
    assert t.score("m", "s0") == pytest.approx(2.0)
    clock.t += 60.0
    assert t.score("m", "s0") == pytest.approx(1.0)
    assert t.record("m", "s0") == pytest.approx(2.0)  # decays, then adds
    assert t.score("m", "s0", now=clock.t + 30.0) == pytest.approx(2.0 * 2**-0.5)
    assert t.score("m", "never") == 0.0


def test_clock_stepping_back_never_raises_a_score():
    clock = FakeClock()
    t = tracker(60.0, clock)
    t.record("m", "s", now=1000.0)
    assert t.score("m", "s", now=900.0) == 1.0


def test_rank_order_recent_beats_old_and_models_sum_shards():
    clock = FakeClock()
    t = tracker(60.0, clock)
    for _ in range(4):
        t.record("old", "a")  # 4 accesses, then two half-lives pass -> 1.0
    clock.t += 120.0
    for _ in range(3):
        t.record("new", "b")  # 3.0
    t.record("new", "c")  # 1.0, ties with old/a -> name order
    t.record("new", "c", weight=0.5)  # 1.5
    t.record("mid", "d", weight=2.0)
    assert [(m, s) for m, s, _ in t.rank(10)] == [("new", "b"), ("mid", "d"), ("new", "c"), ("old", "a")]
    top = t.rank(2)
    assert len(top) == 2 and top[0][2] == pytest.approx(3.0) and top[1][2] == pytest.approx(2.0)
    assert t.rank_models(2) == [("new", pytest.approx(4.5)), ("mid", pytest.approx(2.0))]
    assert t.rank(0) == []


def test_decayed_entries_are_dropped():
    clock = FakeClock()
    t = PopularityTracker(PopularityConfig(half_life_s=1.0, clock=clock, min_score=0.01))
    t.record("m", "gone")
    clock.t += 10.0  # 2**-10 < 0.01
    t.record("m", "kept")
    assert [s for _, s, _ in t.rank(5)] == ["kept"] and len(t) == 1


def test_save_load_round_trip_is_atomic(tmp_path):
    clock = FakeClock()
    t = tracker(30.0, clock)
    for i in range(5):
        for _ in range(i + 1):
            t.record(f"model{i % 2}", f"shard{i}")
        clock.t += 7.0
    path = tmp_path / "popularity.json"
    t.save(path)
    t.save(path)  # overwrite in place
    assert os.listdir(tmp_path) == ["popularity.json"]  # no staged file left behind
    back = PopularityTracker.load(path, PopularityConfig(half_life_s=30.0, clock=clock))
    assert back.rank(10) == t.rank(10) and back.rank_models(10) == t.rank_models(10)
    clock.t += 30.0
    assert back.rank(1)[0][2] == pytest.approx(t.rank(1)[0][2])
    default = PopularityTracker.load(path)
    assert default.config.half_life_s == 30.0 and len(default) == 5


def test_load_rejects_bad_files_and_config_validates(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(InvalidRequest):
        PopularityTracker.load(bad)
    bad.write_text(json.dumps({"format": "other/9", "half_life_s": 1, "entries": []}))
    with pytest.raises(InvalidRequest, match="unknown format"):
        PopularityTracker.load(bad)
    with pytest.raises(FileNotFoundError):
        PopularityTracker.load(tmp_path / "missing.json")
    for kwargs in (dict(half_life_s=0), dict(half_life_s=float("inf")), dict(min_score=-1)):
        with pytest.raises(InvalidRequest):
            PopularityConfig(**kwargs)
    with pytest.raises(InvalidRequest):
        tracker().record("", "s")
    with pytest.raises(InvalidRequest):
        tracker().record("m", "s", weight=-1)
