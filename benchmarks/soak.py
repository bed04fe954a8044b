"""`pdserve bench soak`: tens of minutes of mixed load with a node killed every few minutes and a second model
swapped in and out; nothing may grow without bound and everything must return to idle when the load stops.

    pdserve bench soak [--store URL ...] [--duration-s 1500] [--warmup-s 300] [--clients 6] [--prefill 1]
                       [--decode 2] [--kill-every-s 300] [--swap-every-s 300] [--sample-s 10]
                       [--out bench-results/soak.json]

Lifecycle: two models imported once from the real SmolLM2 GGUF with the ChatML-with-tools template -> `pdserve up
--model soak-a --model soak-b --prefill P --decode D --autoscale` (a standby runtime per role; ``soak-b``, asked for
only by the swaps, scaled to zero after ``--idle-s``) -> ``--clients`` closed-loop clients send the mix of
benchmarks/soak_requests.py (a shared long system prompt, plain chats, n = 2, JSON schema, a forced tool call,
the Responses API, a client that hangs up mid-stream) for ``--duration-s``; every ``--swap-every-s`` a few
requests name ``soak-b`` (the pool loads it on a standby runtime; it goes back to zero when idle); every
``--kill-every-s`` (the first at half) one node serving ``soak-a`` gets SIGKILL (benchmarks/chaos.py's kill)
-> the load stops -> up to ``--idle-wait-s`` for every counter to return to idle -> the service stopped.

Sampled every ``--sample-s`` (benchmarks/soak_sample.py): per process of the service (the gateway's, each node
and standby runtime) RSS, open file descriptors and threads; per node its KV blocks used, cached, held for a
handoff and its transfers held, requests active and queued; the gateway's queue depth and running requests.
Growth is the least-squares slope over the samples after ``--warmup-s``, per hour, per process alive for most
of that window (a process started by a kill is counted once it has lived long enough).

Failures: a request that failed within ``DRILL_GRACE_S`` of a kill is the drill's own (counted apart); any other
is a failure of the soak, and so is a traceback or an ERROR line in the service's logs (a killed node's own log
ends without one). Exit code 1 on a failure of the soak or counters not back to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.chaos import kill_one
from benchmarks.common import cpu_flags, cpu_model, loadavg
from benchmarks.service import UpService
from benchmarks.soak_requests import MIX, send
from benchmarks.soak_sample import growth, idle, sample

TEMPLATE = Path(__file__).parents[1] / "deploy" / "chat-templates" / "chatml-tools.jinja"
DRILL_GRACE_S = 10.0  # after a kill is back to full strength: failures this close to a kill are the drill's


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="soak-a", help="the model served throughout (imported from the GGUF)")
    p.add_argument("--swap-model", default="soak-b", help="the model swapped in every --swap-every-s")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients sending the mix")
    p.add_argument("--duration-s", type=float, default=1500.0)
    p.add_argument("--warmup-s", type=float, default=300.0, help="growth is measured after this")
    p.add_argument("--kill-every-s", type=float, default=300.0, help="0: no kills")
    p.add_argument("--swap-every-s", type=float, default=300.0, help="0: no swaps")
    p.add_argument("--swap-requests", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=60.0, help="[autoscaler] scale_to_zero_after_s (the swap model)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--idle-wait-s", type=float, default=90.0, help="longest wait for idle after the load")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default="bench-results/soak.json")


def _ensure(cfg, names: list[str]) -> list[str]:
    """Import each of `names` from the real GGUF with the tools template, once."""
    from paramstore import NotFound, ParamStore
    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    with ParamStore(cfg) as store:
        for name in names:
            try:
                store.manifest(name)
            except NotFound:
                src = open_source(str(gguf_path()))
                src.set_chat_template(str(TEMPLATE))
                print(f"importing {name!r} (int8, tools template), once ...", file=sys.stderr, flush=True)
                store.import_model(src, name, dtype="int8")
    return list(cfg.locations)


def _tables(args) -> dict:
    plan_max = max(args.prefill, args.decode)
    return {"gateway": {"max_running": 64, "max_queue": 256, "queue_timeout_s": 120.0},
            "node": {"threads": 1, "kv_blocks": 512},
            "autoscaler": {"tick_s": 1.0, "pool_size": 1, "scale_to_zero_after_s": args.idle_s,
                           "prefill_min_replicas": 0, "prefill_max_replicas": plan_max,
                           "decode_min_replicas": 0, "decode_max_replicas": plan_max}}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from paramstore.config import store_config

    if args.duration_s <= args.warmup_s or args.clients < 1 or args.sample_s <= 0:
        raise ValueError("--duration-s must exceed --warmup-s; --clients >= 1; --sample-s > 0")
    locations = _ensure(store_config(args), [args.model, args.swap_model])
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-soak-")
    plan = {"prefill": args.prefill, "decode": args.decode}
    report = {"models": [args.model, args.swap_model], "plan": plan, "clients": args.clients, "mix": MIX,
              "duration_s": args.duration_s, "warmup_s": args.warmup_s, "kill_every_s": args.kill_every_s,
              "swap_every_s": args.swap_every_s, "cpus": len(os.sched_getaffinity(0)), "cpu": cpu_model(),
              "cpu_flags": cpu_flags(), "load_avg_start": loadavg(), "log_dir": log_dir}  # fmt: skip
    svc = UpService([args.model, args.swap_model], locations, log_dir, _tables(args), plan, autoscale=True)
    try:
        svc.start()
        svc.wait_ready()
        svc.wait_for(lambda st: _serving(st, args.model, plan), 180, f"{args.model} on the plan's nodes")
        report.update(_soak(svc, args))
    finally:
        report["up_exit_code"] = svc.stop()
    report["load_avg_end"] = loadavg()
    report["log_errors"] = log_errors(log_dir)
    print(table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 1 if report["failed_outside_drills"] or not report["idle"]["reached"] or report["log_errors"] else 0


def log_errors(log_dir: str) -> dict[str, int]:
    """Per log file of the service (the gateway's up.log, each node's), its tracebacks and ERROR lines."""
    out = {}
    for path in sorted(Path(log_dir).rglob("*.log")):
        text = path.read_text(errors="replace")
        n = text.count("Traceback (most recent call last)") + text.count(" ERROR ")
        if n:
            out[str(path.relative_to(log_dir))] = n
    return out


def _serving(st: dict, model: str, plan: dict[str, int]) -> bool:
    from benchmarks.observe import count_ready

    ready = count_ready(st, model)
    return all(ready.get(r, 0) >= n for r, n in plan.items())


def _soak(svc: UpService, args) -> dict:
    t0 = time.monotonic()
    end = t0 + args.duration_s
    records: list[dict] = []
    samples: list[dict] = []
    kills: list[dict] = []
    load = threading.Thread(target=lambda: records.extend(asyncio.run(_load(svc, args, t0, end))), daemon=True)
    drills = threading.Thread(target=lambda: kills.extend(_kills(svc, args, t0, end)), daemon=True)
    load.start()
    drills.start()
    while time.monotonic() < end:
        samples.append(sample(svc, t0))
        time.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
    load.join(300)
    drills.join(120)
    stopped = time.monotonic() - t0
    idle_state = idle(svc, t0, args.idle_wait_s, samples)
    drill_windows = [(k["t"], k["t"] + (k["back_s"] or 60.0) + DRILL_GRACE_S) for k in kills]
    failed = [r for r in records if not r["ok"]]
    own = [r for r in failed if any(a <= r["t"] + r.get("s", 0) and r["t"] <= b for a, b in drill_windows)]
    outside = [r for r in failed if r not in own]
    by_kind: dict[str, list[int]] = {}
    for r in records:
        c = by_kind.setdefault(r["kind"], [0, 0])
        c[0] += 1
        c[1] += not r["ok"]
    return {"kills": kills, "requests_total": len(records), "by_kind": by_kind, "failed_in_drills": len(own),
            "failed_outside_drills": len(outside), "errors_outside_drills": [
                {k: r.get(k) for k in ("t", "kind", "model", "error")} for r in outside[:20]],
            "errors_in_drills": sorted({r.get("error", "")[:120] for r in own})[:10],
            "load_stopped_s": round(stopped, 1), "idle": idle_state, "growth": growth(samples, args.warmup_s),
            "samples": samples}  # fmt: skip


async def _load(svc: UpService, args, t0: float, end: float) -> list[dict]:
    import httpx

    out: list[dict] = []
    kinds, weights = list(MIX), list(MIX.values())
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0, connect=10.0), limits=limits) as client:
        async def worker(i: int):
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < end:
                out.append(await send(rng.choices(kinds, weights)[0], client, svc.url, args.model, rng, t0))

        async def swaps():
            rng = random.Random(args.seed)
            at = args.swap_every_s / 3
            while args.swap_every_s > 0 and t0 + at < end:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                for _ in range(args.swap_requests):
                    out.append({**await send("plain", client, svc.url, args.swap_model, rng, t0), "kind": "swap"})
                at += args.swap_every_s

        await asyncio.gather(swaps(), *(worker(i) for i in range(args.clients)))
    return out


def _kills(svc: UpService, args, t0: float, end: float) -> list[dict]:
    """A node serving the model killed every ``--kill-every-s``; "back" once as many nodes of each role serve it
    as just before the kill (the autoscaler moves the count between kills)."""
    from benchmarks.observe import count_ready

    rng = random.Random(args.seed)
    out: list[dict] = []
    at = args.kill_every_s / 2
    while args.kill_every_s > 0 and t0 + at < end - 30:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        out.append(kill_one(svc, args, count_ready(svc.status(), args.model), rng, t0))
        at += args.kill_every_s
    return out


def table(r: dict) -> str:
    plan = " + ".join(f"{n} {role}" for role, n in r["plan"].items())
    lines = [f"soak: {plan}, {r['clients']} clients, {r['duration_s']:g} s (growth after {r['warmup_s']:g} s); "
             f"{r['cpus']} cores {r['cpu']}; load avg {r['load_avg_start']} -> {r['load_avg_end']}",
             f"requests {r.get('requests_total')}: failed {r.get('failed_outside_drills')} outside the drills, "
             f"{r.get('failed_in_drills')} within {DRILL_GRACE_S:g} s of a kill; "
             + ", ".join(f"{k} {n}/{f}" for k, (n, f) in sorted(r.get("by_kind", {}).items())),
             "kills: " + ", ".join(f"{k['role']} at {k['t']} s back {k['back_s']} s" for k in r.get("kills", [])),
             f"{'quantity':34} {'processes':>9} {'first':>10} {'last':>10} {'growth / h':>11} {'% / h':>7}"]  # fmt: skip
    for name, g in sorted(r.get("growth", {}).items()):
        pct = "-" if g["pct_per_h"] is None else f"{g['pct_per_h']:+.1f}"
        lines.append(f"{name:34} {g['series']:>9} {g['first']:>10.4g} {g['last']:>10.4g} {g['per_h']:>+11.4g} "
                     f"{pct:>7}")  # fmt: skip
    lines.append(f"tracebacks and ERROR lines in the service's logs: {r.get('log_errors') or 'none'}")
    i = r.get("idle", {})
    lines.append(f"idle after the load: {'reached' if i.get('reached') else 'NOT reached'} in {i.get('after_s')} s; "
                 f"{i.get('last')}")  # fmt: skip
    return "\n".join(lines)
