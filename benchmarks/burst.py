"""`pdserve bench burst`: a burst sized from the service's measured capacity, with and without the warm pool.

    pdserve bench burst [--store URL ...] [--model smollm2] [--burst-x 3] [--steady-x 0.25] [--steady-s 10]
                        [--burst-s 15] [--after-max-s 45] [--runs pool,cold] [--out bench-results/burst.json]

Each run is the real `pdserve up --prefill 1 --decode 1 --autoscale` in a process of its own
(benchmarks/service.py), its [autoscaler] sized for seconds (0.5 s ticks, 10 s stable / 2 s panic
windows, 15 s cooldown, at most --max-replicas per role; the targets are the policy's own, from
what the nodes measure) and differing only in ``pool_size``: 1 standby runtime per role (``pool``:
scale-up claims it and injects the model) or 0 (``cold``: scale-up starts a `pdserve node` process).
Both runs happen in one invocation, one after the other, on the same box; then, beside them, the run
with the defaults (``defaults``, benchmarks/burst_defaults.py): `pdserve up --autoscale` on a store of
``--defaults-models`` models with no config table at all, ``--defaults-clients`` concurrent streaming chats
of one of them.

First, once: the capacity probe, on a `pdserve up --prefill 1 --decode 1` of its own without
--autoscale (so 1 + 1 stay 1 + 1 and no SLO window of the probe holds a measured run back):
``--probe-clients`` closed-loop clients share ``--probe-requests`` streaming chats; the completed
req/s is the capacity X of 1 + 1 (the nodes' own capacity report is recorded beside it).

Lifecycle of a run: start -> the gateway ready -> settle: 1 + 1 serving and, with the pool, a
standby runtime per role, held 3 s -> 2 warm-up requests -> open-loop arrivals: ``--steady-x`` X
for ``--steady-s``, ``--burst-x`` X for ``--burst-s`` (the overload), ``--steady-x`` X until settled
again (at most ``--after-max-s``) -> every request finished -> the service stopped.

Reported per run (table, JSON, PNG of the pool run — replicas and TTFT over time): seconds from
burst onset to new capacity ready (a node that did not have the model ready at onset has it ready)
and to the first request served by new capacity (such a node shows a request of the model in its
/load), per role and the first of both; failed requests (must be 0); TTFT p50/p99 before, during
and after the burst. A node's /load is read directly every 0.1 s, so events are timed to ~0.1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from benchmarks import burst_defaults
from benchmarks.common import cpu_flags, ensure_model, loadavg
from benchmarks.loadgen import Sample, chat_stream, closed_loop, pct, summarize
from benchmarks.service import (
    Sampler,
    UpService,
    count_ready,
    count_standby,
    node_model,
    status_nodes,
)

PROMPT = "Give me one tip for learning Python."
ROLES = ("prefill", "decode")
RUNS = ("pool", "cold", "defaults")  # defaults: benchmarks/burst_defaults.py


def autoscaler_table(max_replicas: int, pool_size: int) -> dict:
    """[autoscaler] for a seconds-scale run on a small CPU box (the defaults are sized for minutes)."""
    return {"tick_s": 0.5, "stable_window_s": 10.0, "panic_window_s": 2.0, "panic_threshold": 2.0,
            "scale_down_delay_s": 15.0, "max_scale_down_fraction": 0.5, "max_scale_down_step": 1,
            "prefill_min_replicas": 1, "prefill_max_replicas": max_replicas,
            "decode_min_replicas": 1, "decode_max_replicas": max_replicas,
            "pool_size": pool_size, "scale_to_zero_after_s": 0.0}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="model in the store (imported from the real GGUF if absent)")
    p.add_argument("--runs", default="pool,cold,defaults",
                   help="which runs, in this order: pool, cold, defaults (comma-separated)")
    burst_defaults.add_arguments(p)
    p.add_argument("--burst-x", type=float, default=3.0, help="burst rate = this x the measured capacity")
    p.add_argument("--steady-x", type=float, default=0.25, help="rate before and after = this x the capacity")
    p.add_argument("--rate", type=float, default=None, help="capacity in req/s (skips the probe)")
    p.add_argument("--probe-clients", type=int, default=16)
    p.add_argument("--probe-requests", type=int, default=48)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=15.0)
    p.add_argument("--after-max-s", type=float, default=45.0, help="low load after the burst, at most this long")
    p.add_argument("--settle-max-s", type=float, default=90.0, help="wait at most this long for 1 + 1 (+ pool)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-replicas", type=int, default=2, help="per role")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--log-dir", default=None, help="service and node logs (default: a temporary folder)")
    p.add_argument("--out", default="bench-results/burst.json")
    p.add_argument("--plot", default="bench-results/burst.png", help="replicas/TTFT of the pool run")


def main(args: argparse.Namespace) -> int:
    from paramstore.config import store_config

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        raise ValueError(f"--runs: comma-separated names from {', '.join(RUNS)}")
    if min(args.burst_x, args.steady_x, args.steady_s, args.burst_s) <= 0 or args.steady_x >= 1 < args.burst_x:
        raise ValueError("need 0 < --steady-x < 1 < --burst-x and positive durations")
    locations = ensure_model(store_config(args), args.model)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-burst-")
    report = {"model": args.model, "max_tokens": args.max_tokens, "prompt": args.prompt, "cpus": os.cpu_count(),
              "cpu_flags": cpu_flags(), "load_avg_start": loadavg(), "runs": {}, "capacity": None}  # fmt: skip
    capacity = None if args.rate is None else {"req_per_s": args.rate, "source": "--rate"}
    plots = {}
    tuned = [m for m in runs if m != "defaults"]
    if capacity is None and tuned:
        capacity = _probe_service(args, locations, os.path.join(log_root, "probe"))
        print(f"capacity of 1 + 1: {capacity['req_per_s']} req/s (probe)", file=sys.stderr, flush=True)
    for mode in tuned:
        print(f"--- run {mode!r} (logs in {log_root}/{mode}) ---", file=sys.stderr, flush=True)
        result, capacity, samples = _run(args, mode, locations, os.path.join(log_root, mode), capacity)
        report["runs"][mode] = result
        plots[mode] = samples
    if "defaults" in runs:
        print(f"--- run 'defaults' (logs in {log_root}/defaults) ---", file=sys.stderr, flush=True)
        report["defaults"] = burst_defaults.run(args, store_config(args), os.path.join(log_root, "defaults"))
    report["capacity"] = capacity
    report["load_avg_end"] = loadavg()
    pool, cold = (report["runs"].get(k, {}).get("onset_to_first_served_s") for k in ("pool", "cold"))
    report["cold_over_pool"] = round(cold / pool, 2) if pool and cold else None
    print(_table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    if "pool" in plots and _plot(report["runs"]["pool"], plots["pool"], args.plot, f"{args.model}, warm pool"):
        print(f"wrote {args.plot}")
    failed = sum(r["requests_failed"] for r in [*report["runs"].values(), *filter(None, [report.get("defaults")])])
    return 1 if failed else 0


def _run(args, mode: str, locations: list[str], log_dir: str, capacity: dict | None):
    pool_size = 1 if mode == "pool" else 0
    svc = UpService([args.model], locations, log_dir, _tables(args, pool_size), {r: 1 for r in ROLES})
    sampler = None
    try:
        svc.start()
        ready_s = svc.wait_ready()
        print(f"{mode}: gateway ready in {ready_s:.1f} s", file=sys.stderr, flush=True)
        if svc.skipped:
            print(f"{mode}: this tree does not know {', '.join(svc.skipped)} (not set)", file=sys.stderr)
        t0 = time.monotonic()
        sampler = Sampler(svc, t0, interval_s=0.1, slow_every=2).start()
        settle_s = _settle(svc, args, pool_size)
        rate = capacity["req_per_s"]
        samples, marks = asyncio.run(_drive(svc, args, rate, pool_size, t0))
    finally:
        if sampler is not None:
            sampler.stop()
        rc = svc.stop()
    result = _result(args, mode, svc, sampler, samples, marks, t0, rate, pool_size)
    result.update({"gateway_ready_s": round(ready_s, 2), "settle_s": settle_s and round(settle_s, 2), "up_exit_code": rc,
                   "not_set": svc.skipped, "log_dir": log_dir})  # fmt: skip
    return result, capacity, (samples, marks, t0)


def _tables(args, pool_size: int) -> dict:
    return {"gateway": {"max_running": 256, "max_queue": 2048, "queue_timeout_s": 180.0},
            "node": {"threads": 1, "kv_blocks": 1024},
            "autoscaler": autoscaler_table(args.max_replicas, pool_size)}  # fmt: skip


def _probe_service(args, locations: list[str], log_dir: str) -> dict:
    """The capacity probe on its own `pdserve up --prefill 1 --decode 1` without --autoscale (1 + 1 stay
    1 + 1, and no slow SLO window is left over to hold the measured runs' scale-down back)."""
    svc = UpService([args.model], locations, log_dir, _tables(args, 0), {r: 1 for r in ROLES}, autoscale=False)
    try:
        svc.start()
        svc.wait_ready()
        svc.wait_for(lambda st: all(count_ready(st, args.model).get(r, 0) for r in ROLES), 120, "1 + 1 ready")
        return asyncio.run(_probe(svc, args))
    finally:
        svc.stop()


def _settled(status: dict | None, model: str, pool_size: int) -> bool:
    ready, standby = count_ready(status, model), count_standby(status)
    return (all(ready.get(r, 0) == 1 for r in ROLES) and all(standby.get(r, 0) >= pool_size for r in ROLES)
            and not (status or {}).get("queue_depth"))  # fmt: skip


def _settle(svc: UpService, args, pool_size: int, hold_s: float = 3.0) -> float | None:
    """Wait until 1 + 1 serve the model and the pool is full, for hold_s in a row; -> seconds waited
    (None: not in --settle-max-s)."""
    since: list[float] = []

    def held(st) -> bool:
        if not _settled(st, args.model, pool_size):
            since.clear()
            return False
        since[:] = since or [time.monotonic()]
        return time.monotonic() - since[0] >= hold_s

    try:
        return svc.wait_for(held, args.settle_max_s, "1 prefill + 1 decode serving, the pool full")
    except TimeoutError:  # measured anyway; the report says it did not settle
        st = svc.status()
        print(f"warning: not settled in {args.settle_max_s:g} s: serving {count_ready(st, args.model)}, "
              f"standby {count_standby(st)}", file=sys.stderr, flush=True)  # fmt: skip
        return None


async def _probe(svc: UpService, args) -> dict:
    """Closed loop at --probe-clients: completed req/s is the capacity; the nodes' own report beside it."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        make = lambda: chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)
        for _ in range(2):
            await make()
        samples, wall = await closed_loop(make, args.probe_clients, args.probe_requests)
    s = summarize(samples, wall)
    nodes = {n["url"]: (node_model(n.get("load"), args.model).get("capacity")) for n in status_nodes(svc.status())}
    return {"req_per_s": s["req_per_s"], "source": f"closed loop, {args.probe_clients} clients", "probe": s,
            "node_capacity": nodes}  # fmt: skip


async def _drive(svc: UpService, args, rate: float, pool_size: int, t0: float):
    """Open-loop arrivals: steady, burst, steady until settled (+3 s); -> (samples, phase marks)."""
    import httpx

    samples: list[tuple[str, Sample]] = []
    tasks: list[asyncio.Task] = []
    marks: dict[str, float] = {}
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:

        async def one(phase: str):
            s = await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)
            samples.append((phase, s))

        async def phase(name: str, r: float, until, max_s: float):
            start = marks[name] = time.monotonic() - t0
            k = 0
            while time.monotonic() - t0 - start < max_s and not await until():
                tasks.append(asyncio.create_task(one(name)))
                k += 1
                await asyncio.sleep(max(0.0, t0 + start + k / r - time.monotonic()))
            marks[name + "_end"] = time.monotonic() - t0

        for _ in range(2):  # warm-up, not counted
            await chat_stream(client, svc.url, args.model, args.prompt, args.max_tokens)

        async def never():
            return False

        await phase("before", rate * args.steady_x, never, args.steady_s)
        await phase("during", rate * args.burst_x, never, args.burst_s)
        back: list[float] = []

        async def settled() -> bool:
            st = await asyncio.to_thread(svc.status)
            if _settled(st, args.model, pool_size) and time.monotonic() - t0 - marks["during_end"] > 1.0:
                back[:] = back or [time.monotonic()]
            return bool(back) and time.monotonic() - back[0] > 3.0

        await phase("after", rate * args.steady_x, settled, args.after_max_s)
        marks["settled"] = (back[0] - t0) if back else None
        print(f"load done; waiting for {sum(not t.done() for t in tasks)} requests in flight", file=sys.stderr)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return samples, marks


def _result(args, mode, svc, sampler: Sampler, samples, marks, t0, rate, pool_size) -> dict:
    onset = marks["during"]
    old = sampler.ready_nodes(args.model, onset)
    roles = {u: n["role"] for row in sampler.rows for u, n in row["nodes"].items()}
    at_onset = {r: sum(1 for u in old if roles.get(u) == r) for r in ROLES}
    ready = sampler.first(args.model, onset, old, "ready")
    served = sampler.first(args.model, onset, old, "active")
    decided = sampler.first_scale_up(args.model, onset)
    rel = lambda t: None if t is None else round(t - onset, 2)
    first = lambda d: rel(min(d.values())) if d else None
    ms = lambda x: None if x is None else round(x * 1000, 1)
    phases = {}
    for name in ("before", "during", "after"):
        ss = [s for p, s in samples if p == name]
        ttft = [s.ttft for s in ss if s.ok and s.ttft is not None]
        phases[name] = {"requests": len(ss), "failed": sum(1 for s in ss if not s.ok),
                        "rate_per_s": round(rate * (args.burst_x if name == "during" else args.steady_x), 2),
                        "seconds": round(marks[name + "_end"] - marks[name], 1),
                        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99))}  # fmt: skip
    timeline = sampler.compact(args.model)
    peak = {r: max([row.get(f"{r}_ready", 0) for row in timeline] or [0]) for r in ROLES}
    return {
        "mode": mode, "pool_size": pool_size, "capacity_req_per_s": rate, "phases": phases,
        "requests_total": len(samples), "requests_failed": sum(1 for _, s in samples if not s.ok),
        "errors": sorted({s.error for _, s in samples if s.error})[:10],
        "onset_to_scale_up_decision_s": rel(decided[0]) if decided else None,
        "scale_up_reason": decided[1] if decided else None,
        "decision_to_first_served_s": round(min(served.values()) - decided[0], 2) if decided and served else None,
        "onset_to_new_capacity_ready_s": first(ready), "onset_to_first_served_s": first(served),
        "onset_to_ready_by_role_s": {r: rel(t) for r, t in ready.items()},
        "onset_to_served_by_role_s": {r: rel(t) for r, t in served.items()},
        "serving_at_onset": sorted(old), "serving_at_onset_by_role": at_onset, "peak_ready_replicas": peak,
        "burst_end_to_settled_s": None if marks.get("settled") is None else round(marks["settled"] - marks["during_end"], 2),
        "burst_window_s": [round(onset, 2), round(marks["during_end"], 2)],
        "memory": svc.memory(), "timeline": timeline,
        "requests": [{"phase": p, "start_s": round(s.start - t0, 3), "ok": s.ok, "tokens": s.tokens,
                      "ttft_ms": ms(s.ttft)} for p, s in samples],
    }  # fmt: skip


def _table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x}"
    cap = r["capacity"] or {}
    lines_d = burst_defaults.table(r["defaults"]) if r.get("defaults") else ""
    lines = [(f"capacity of 1 prefill + 1 decode: {f(cap.get('req_per_s'))} req/s ({cap.get('source', '-')}); "
              f"CPU flags: {' '.join(r['cpu_flags']) or '-'}; load avg {f(r['load_avg_start'])}"), ""]
    head = f"{'run':<5} {'phase':<7} {'req/s':>6} {'secs':>5} {'reqs':>5} {'failed':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
    lines += [head, "-" * len(head)]
    for mode, run in r["runs"].items():
        for name, p in run["phases"].items():
            lines.append(f"{mode:<5} {name:<7} {p['rate_per_s']:>6} {p['seconds']:>5} {p['requests']:>5} {p['failed']:>6} "
                         f"{f(p['ttft_p50_ms']):>12} {f(p['ttft_p99_ms']):>12}")  # fmt: skip
    lines.append("")
    lines.append("serving at onset / peak: prefill+decode nodes with the model ready")
    head = (f"{'run':<5} {'onset->decision':>16} {'onset->new capacity ready':>26} {'onset->first served by it':>26} "
            f"{'failed':>9} {'at onset':>9} {'peak':>5}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for mode, run in r["runs"].items():
        peak = "+".join(str(v) for v in run["peak_ready_replicas"].values())
        lines.append(f"{mode:<5} {f(run['onset_to_scale_up_decision_s']) + ' s':>16} "
                     f"{f(run['onset_to_new_capacity_ready_s']) + ' s':>26} "
                     f"{f(run['onset_to_first_served_s']) + ' s':>26} "
                     f"{str(run['requests_failed']) + '/' + str(run['requests_total']):>9} "
                     f"{'+'.join(str(v) for v in run['serving_at_onset_by_role'].values()):>9} {peak:>5}")  # fmt: skip
    for mode, run in r["runs"].items():
        lines.append(f"{mode}: decision -> first served by new capacity {f(run['decision_to_first_served_s'])} s; "
                     f"the decision: {run['scale_up_reason'] or '-'}")  # fmt: skip
    if r.get("cold_over_pool"):
        lines.append(f"cold process / warm pool (onset -> first served): {r['cold_over_pool']}x")
    if lines_d:
        lines += ["", lines_d]
    return "\n".join(lines)


def _plot(run: dict, data, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    samples, _, t0 = data
    b0, b1 = run["burst_window_s"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    tl = run["timeline"]
    ts = [row["t"] for row in tl]
    for role, color in zip(ROLES, ("tab:blue", "tab:orange")):
        ax.step(ts, [row.get(f"{role}_ready", 0) for row in tl], where="post", color=color, label=f"{role} serving")
        ax.step(ts, [row.get(f"{role}_runtimes", 0) for row in tl], where="post", color=color, linestyle=":",
                label=f"{role} runtimes (incl. standby)")  # fmt: skip
    for a in (ax, ax2):
        a.axvspan(b0, b1, color="tab:red", alpha=0.1, label="burst" if a is ax else None)
    for at, color, label in ((run["onset_to_scale_up_decision_s"], "tab:purple", "scale-up decision"),
                             (run["onset_to_first_served_s"], "tab:green", "first served by new capacity")):
        if at is not None:
            for a in (ax, ax2):
                a.axvline(b0 + at, color=color, linestyle="--", label=label if a is ax else None)
    ax.set_ylabel("nodes")
    ax.set_ylim(0, max([row.get(f"{r}_runtimes", 0) for row in tl for r in ROLES] or [1]) + 0.5)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"pdserve bench burst: {title}, {run['phases']['during']['rate_per_s']} req/s burst")
    ok = [(s.start - t0, s.ttft) for _, s in samples if s.ok and s.ttft is not None]
    bad = [s.start - t0 for _, s in samples if not s.ok]
    ax2.scatter([x for x, _ in ok], [y for _, y in ok], s=6, label="TTFT (s)")
    if bad:
        ax2.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    ax2.set_ylabel("TTFT (s) by request start")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
