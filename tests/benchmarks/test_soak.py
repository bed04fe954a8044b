"""benchmarks/soak.py: its growth figures on samples made for it (a leak is found, a process's own warm-up and a
short life are not counted as growth), and CI's short soak: `pdserve bench soak` run as a user runs it, for a
few minutes with a kill and a swap, exits 0 (no failure outside the drill, no traceback or ERROR in the service's
logs, every counter back to idle) and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.soak_sample import growth


def _row(t: float, procs: dict, cached: int = 0) -> dict:
    return {"t": t, "procs": procs, "nodes": {"n1": {"kv_blocks_cached": cached, "kv_blocks_used": 0}},
            "gateway": {"queue_depth": 0}}  # fmt: skip


def test_growth_finds_a_leak_and_counts_each_process_after_its_own_warm_up():
    rows = []
    for i in range(61):  # 600 s, a sample every 10 s, warm-up 100 s
        t = 10.0 * i
        procs = {"1": {"kind": "gateway", "rss_mib": 300 + 0.1 * t, "fds": 20, "threads": 8}}  # 360 MiB/h: a leak
        if t >= 200:  # a runtime started by a kill: +200 MiB as it loads, in its warm-up; flat after it
            procs["2"] = {"kind": "node-decode", "rss_mib": 500.0 if t >= 250 else 300.0, "fds": 10, "threads": 4}
        if 100 <= t < 200:  # one that lived 100 s: too short to count
            procs["3"] = {"kind": "node-prefill", "rss_mib": 10 * t, "fds": 10, "threads": 4}
        rows.append(_row(t, procs, cached=min(int(t), 48)))
    g = growth(rows, 100.0)
    assert abs(g["gateway rss_mib"]["per_h"] - 360.0) < 1 and g["gateway fds"]["per_h"] == 0
    assert g["node-decode rss_mib"]["per_h"] == 0 and g["node-decode rss_mib"]["first"] == 500.0
    assert "node-prefill rss_mib" not in g
    assert g["node kv_blocks_cached"]["last"] == 48


@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_short_soak_passes(tmp_path, real_model_store):
    out = tmp_path / "soak.json"
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    stores = [a for loc in real_model_store[0] for a in ("--store", loc)]  # soak-a and soak-b imported beside it
    cmd = [sys.executable, "-m", "autoscaler.cli", "bench", "soak", *stores,
           "--duration-s", "150", "--warmup-s", "60", "--kill-every-s", "80", "--swap-every-s", "60",
           "--idle-s", "20", "--sample-s", "5", "--clients", "4", "--out", str(out),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests_total"] > 50 and report["failed_outside_drills"] == 0 and report["log_errors"] == {}
    assert report["idle"]["reached"] and len(report["kills"]) == 1
    assert set(report["by_kind"]) == {"prefix", "plain", "n2", "grammar", "tools", "responses", "abort", "swap"}
    assert all(failed == 0 for _, failed in report["by_kind"].values()), report["by_kind"]
    assert "gateway rss_mib" in report["growth"] and "soak:" in r.stdout
