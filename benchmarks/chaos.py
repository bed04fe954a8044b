"""`pdserve bench chaos`: kill -9 a random serving node every ``--every-s`` under load; every request must complete
and the service must be back at full strength within seconds of each kill.

    pdserve bench chaos [--store URL ...] [--model smollm2] [--prefill 2] [--decode 2] [--clients 6]
                        [--duration-s 100] [--every-s 20] [--max-tokens 32] [--out bench-results/chaos.json]

Lifecycle: `pdserve up --prefill P --decode D` (benchmarks/service.py; the defaults otherwise: a warm pool
of 1 standby runtime per role) -> settled: P + D serving the model and a standby per role -> ``--clients``
closed-loop streaming chats for ``--duration-s`` -> every ``--every-s`` (the first at half of it) one node
holding the model, chosen at random (``--seed``), is sent SIGKILL -> the load stops, every request finished
-> the service stopped.

"Full strength": the gateway's snapshot shows P + D nodes with the model ready, the killed one not among
them. Per kill: the role, how the time back went (the gateway saw it gone, a replacement held the model
loading, ready), and seconds kill -> full strength (the snapshot is read every 0.05 s). Reported: the
worst and the median, failed requests (must be 0), and the pool's claims (a standby claimed, or a cold
start) from `pdserve status`'s supervisor view.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

from benchmarks.common import cpu_flags, ensure_model, loadavg
from benchmarks.loadgen import chat_stream, closed_loop, pct
from benchmarks.service import UpService, count_ready, count_standby, node_model_state, status_nodes

PROMPT = "Give me one tip for learning Python."


def add_arguments(p) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="model in the store (imported from the real GGUF if absent)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--clients", type=int, default=6, help="closed-loop streaming chats")
    p.add_argument("--duration-s", type=float, default=100.0)
    p.add_argument("--every-s", type=float, default=20.0, help="a kill every this many seconds (the first at half)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle-max-s", type=float, default=120.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default="bench-results/chaos.json")


def main(args) -> int:
    from paramstore.config import store_config

    locations = ensure_model(store_config(args), args.model)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-chaos-")
    plan = {"prefill": args.prefill, "decode": args.decode}
    report = {"model": args.model, "plan": plan, "clients": args.clients, "cpus": len(os.sched_getaffinity(0)),
              "cpu_flags": cpu_flags(), "load_avg_start": loadavg(), "log_dir": log_dir}  # fmt: skip
    svc = UpService([args.model], locations, log_dir, {}, plan, autoscale=False)
    try:
        svc.start()
        svc.wait_ready()
        svc.wait_for(lambda st: full(st, args.model, plan) and all(count_standby(st).get(r, 0) >= 1 for r in plan),
                     args.settle_max_s, "the plan serving and a standby runtime per role")  # fmt: skip
        kills, samples = drill(svc, args, plan)
        report["supervisor"] = (svc.status() or {}).get("supervisor")
    finally:
        rc = svc.stop()
    back = [k["back_s"] for k in kills if k["back_s"] is not None]
    report.update({"kills": kills, "worst_back_s": max(back) if len(back) == len(kills) and back else None,
                   "median_back_s": pct(back, 50), "requests_total": len(samples),
                   "requests_failed": sum(1 for s in samples if not s.ok),
                   "errors": sorted({s.error for s in samples if s.error})[:10], "load_avg_end": loadavg(),
                   "up_exit_code": rc})  # fmt: skip
    print(table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 1 if report["requests_failed"] or report["worst_back_s"] is None else 0


def full(st: dict | None, model: str, plan: dict[str, int], gone: str = "") -> bool:
    """The plan's nodes serve the model (the gateway's view), `gone` not among them."""
    if gone and any(n.get("url") == gone for n in status_nodes(st)):
        return False
    ready = count_ready(st, model)
    return all(ready.get(r, 0) >= n for r, n in plan.items())


def drill(svc: UpService, args, plan: dict[str, int]) -> tuple[list[dict], list]:
    """The load in a thread of its own, the kills here; -> (kills, request samples)."""
    rng = random.Random(args.seed)
    out: dict = {}
    t0 = time.monotonic()
    load = threading.Thread(target=lambda: out.update(samples=asyncio.run(_load(svc, args, t0))), daemon=True)
    load.start()
    kills = []
    at = args.every_s / 2
    while at < args.duration_s:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        kills.append(kill_one(svc, args, plan, rng, t0))
        at += args.every_s
    load.join(args.duration_s + 300)
    return kills, out.get("samples", [])


def kill_one(svc: UpService, args, plan, rng: random.Random, t0: float) -> dict:
    st = svc.status()
    pids = svc.node_pids()
    serving = [n for n in status_nodes(st) if node_model_state(n.get("load"), args.model) == "ready" and n["url"] in pids]
    if not serving:
        return {"t": round(time.monotonic() - t0, 2), "role": None, "back_s": None, "note": "nothing serving"}
    victim = rng.choice(sorted(serving, key=lambda n: n["url"]))
    url, role = victim["url"], victim["role"]
    k = time.monotonic()
    os.kill(pids[url], signal.SIGKILL)
    seen_gone = loading = None
    back = None
    while time.monotonic() - k < 60:
        st = svc.status()
        now = time.monotonic() - k
        urls = {n.get("url") for n in status_nodes(st)}
        if seen_gone is None and url not in urls:
            seen_gone = round(now, 2)
        if loading is None and any(node_model_state(n.get("load"), args.model) == "loading" for n in status_nodes(st)):
            loading = round(now, 2)
        if full(st, args.model, plan, gone=url):
            back = round(now, 2)
            break
        time.sleep(0.05)
    print(f"kill -9 {role} {url} at {k - t0:.1f} s: gone from the gateway {seen_gone} s, a replacement loading "
          f"{loading} s, full strength {back} s", file=sys.stderr, flush=True)  # fmt: skip
    return {"t": round(k - t0, 2), "role": role, "url": url, "gone_s": seen_gone, "loading_s": loading, "back_s": back}


async def _load(svc: UpService, args, t0: float):
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        async def one():
            return await chat_stream(client, svc.url, args.model, PROMPT, args.max_tokens)

        samples, _ = await closed_loop(one, args.clients, 10**6, until=t0 + args.duration_s)
        return samples


def table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x}"  # noqa: E731
    plan = " + ".join(f"{n} {role}" for role, n in r["plan"].items())
    lines = [f"chaos: {plan}, {r['clients']} clients, {len(r['kills'])} kill -9; {r['cpus']} cores, load avg "
             f"{f(r['load_avg_start'])} -> {f(r['load_avg_end'])}",
             f"{'t s':>6} {'role':8} {'gone s':>7} {'loading s':>9} {'full strength s':>15}"]  # fmt: skip
    for k in r["kills"]:
        lines.append(f"{k['t']:>6} {f(k['role']):8} {f(k.get('gone_s')):>7} {f(k.get('loading_s')):>9} "
                     f"{f(k['back_s']):>15}")  # fmt: skip
    lines.append(f"worst back to full strength {f(r['worst_back_s'])} s, median {f(r['median_back_s'])} s; "
                 f"failed {r['requests_failed']}/{r['requests_total']}")  # fmt: skip
    return "\n".join(lines)
