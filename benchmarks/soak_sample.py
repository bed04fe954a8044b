"""What the soak samples and how it reads the samples: one row per tick, growth per hour, the wait for idle.

A row (``sample``): {"t": seconds since t0,
  "procs": {pid: {"kind": gateway | node-ROLE | other, "rss_mib", "fds", "threads", and on a node
           "unaccounted_mib": its RSS less the weights and KV it accounts for (a model loaded is not growth)}}
           (the service's processes: the `pdserve up` process holds the gateway, the supervisor and the autoscaler;
           each runtime is a node; "other": a builder or compiler process),
  "nodes": {url: {"kv_blocks_used", "kv_blocks_cached", "kv_blocks_held", "kv_transfers_held", "active_requests",
           "queued"} (each node's /load, summed over its models), "pid", "memory_used_mib", "models": [those it has
           ready]},
  "gateway": {"queue_depth", "running"}}.
"""

from __future__ import annotations

import os
import time

from benchmarks.service import UpService, proc_status

PROC = ("rss_mib", "fds", "threads")
NODE = ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_held", "kv_transfers_held", "active_requests", "queued")
IDLE_ZERO = ("kv_blocks_used", "kv_blocks_held", "kv_transfers_held", "active_requests", "queued")


def _proc(pid: int) -> dict | None:
    st = proc_status(pid)
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return None if st is None else {"rss_mib": round(st["rss_bytes"] / 2**20, 1), "threads": st["threads"], "fds": fds}


def sample(svc: UpService, t0: float) -> dict:
    row: dict = {"t": round(time.monotonic() - t0, 1), "procs": {}, "nodes": {}, "gateway": {}}
    if svc.p is None:
        return row
    nodes = svc.nodes()
    roles = {pid: role for pid, role in nodes.values()}
    for pid in svc.processes():
        p = _proc(pid)
        if p is not None:
            kind = "gateway" if pid == svc.p.pid else (f"node-{roles[pid]}" if pid in roles else "other")
            row["procs"][str(pid)] = {"kind": kind, **p}
    for url, (pid, _) in nodes.items():
        load = svc.load(url)
        if load is not None:
            models = load.get("models") or {}
            row["nodes"][url] = {**{k: load.get(k, 0) for k in NODE}, "pid": pid,
                                 "memory_used_mib": round((load.get("memory_used_bytes") or 0) / 2**20, 1),
                                 "models": sorted(m for m, v in models.items() if v.get("state") == "ready")}  # fmt: skip
            p = row["procs"].get(str(pid))
            if p is not None:  # what the node holds that its accounting (weights + KV) does not name
                p["unaccounted_mib"] = round(p["rss_mib"] - row["nodes"][url]["memory_used_mib"], 1)
    st = svc.status() or {}
    row["gateway"] = {"queue_depth": st.get("queue_depth"), "running": st.get("running")}
    return row


def _series(samples: list[dict], warmup: float) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(quantity, whose) -> [(t, value)], each series from ``warmup`` seconds after its first sample (a runtime a
    kill replaced, or claimed for a swap, warms up as the service did). A node's series is per set of models it
    holds: loading a model is not growth, and a node that loads one again starts a new series (warmed up again)."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    born: dict[str, float] = {}

    def add(q: str, whose: str, t: float, v: float) -> None:
        if t >= born.setdefault(whose, t) + warmup:
            out.setdefault((q, whose), []).append((t, v))

    for row in samples:
        t = row["t"]
        held = {str(n.get("pid")): ",".join(n.get("models") or []) for n in row["nodes"].values()}
        for pid, p in row["procs"].items():
            whose = f"{pid} [{held[pid]}]" if pid in held else pid  # a node: one series per set of models held
            for q in (*PROC, "unaccounted_mib"):
                if q in p:
                    add(f"{p['kind']} {q}", whose, t, p[q])
        for url, n in row["nodes"].items():
            for q in ("kv_blocks_cached", "kv_blocks_used"):
                add(f"node {q}", url, t, n[q])
        if row["gateway"].get("queue_depth") is not None:
            add("gateway queue_depth", "", t, row["gateway"]["queue_depth"])
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope, per second."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


def growth(samples: list[dict], warmup: float) -> dict[str, dict]:
    """Per quantity, the series that grew fastest after its warm-up among those spanning at least a third of the
    window after the service's (a process that lived long enough in one state): {"series" (how many qualified),
    "first", "last", "per_h", "pct_per_h", "whose"}."""
    if not samples or samples[-1]["t"] <= samples[0]["t"] + warmup:
        return {}
    window = samples[-1]["t"] - samples[0]["t"] - warmup
    worst: dict[str, dict] = {}
    for (q, whose), pts in _series(samples, warmup).items():
        if len(pts) < 5 or pts[-1][0] - pts[0][0] < window / 3:
            continue
        per_h = _slope(pts) * 3600
        mean = sum(v for _, v in pts) / len(pts)
        g = {"whose": whose, "first": pts[0][1], "last": pts[-1][1], "per_h": round(per_h, 3),
             "pct_per_h": round(100 * per_h / mean, 2) if mean else None}  # fmt: skip
        w = worst.get(q)
        count = (w or {}).get("series", 0) + 1
        if w is None or per_h > w["per_h"]:
            worst[q] = g
        worst[q]["series"] = count
    return worst


def idle(svc: UpService, t0: float, wait_s: float, samples: list[dict]) -> dict:
    """Samples every second (appended to ``samples``) until nothing is in use, held, running or queued on any node
    and in the gateway, or ``wait_s``; -> {"reached", "after_s", "last" (the sums at the end)}."""
    start = time.monotonic()
    while True:
        row = sample(svc, t0)
        samples.append(row)
        sums = {k: sum(n[k] for n in row["nodes"].values()) for k in IDLE_ZERO}
        sums.update(row["gateway"])
        reached = not any(sums.get(k) for k in (*IDLE_ZERO, "queue_depth", "running"))
        if reached or time.monotonic() - start >= wait_s:
            return {"reached": reached, "after_s": round(time.monotonic() - start, 1), "last": sums}
        time.sleep(1.0)
