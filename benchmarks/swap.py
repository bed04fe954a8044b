"""`pdserve bench swap`: many models on one small pool — cold-model first token vs a fresh process, and from zero.

    pdserve bench swap [--store URL ...] [--rounds 2] [--memory-gb auto] [--kv-blocks 256]
                       [--out bench-results/swap.json]

Models in the store (imported once, cached): SmolLM2 as int8 (``smollm2``) and as bf16
(``smollm2-bf16``) from the real GGUF, and a synthetic Llama-shaped model of random weights, ~1 GiB
as int8 (``synth1g``, benchmarks/synthetic.py). The service is the real `pdserve up --model ...
--prefill 1 --decode 1 --autoscale` (benchmarks/service.py) with one runtime per role (pool_size 1,
at most 1 per role) and a per-node memory budget (weights + KV) that holds the largest model but
not all of them at once: serving one model means evicting or unloading another.

Lifecycle: start -> the gateway ready -> warm-up: each model once (not counted; the node cache and
the page cache now hold every model's shards) -> ``--rounds`` rounds, each model in turn: request 1
(is the model ready on a node of each role at that moment? if not it is *cold*: held by the
activator while the pool injects it) and request 2 (warm, the control), then — interleaved — a
fresh `pdserve node --role both --model M` process started for it, timed from spawn to the first
token of the same request sent to it directly (what scaling up meant before the pool) -> scale
from zero: the models' idle time passes (``scale_to_zero_after_s``) until no node holds any model,
then each of ``--zero-models`` is requested once (first token from zero replicas), waiting for
zero again between them -> the service stopped.

Reported (table, JSON): per model, cold-request TTFT (pool) p50/max, warm TTFT, fresh process ->
first token p50, their ratio; from zero -> first token per model; per node the memory budget, the
most it reported using, the process's RSS in standby and its peak RSS (VmHWM) — the growth must
stay within the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from benchmarks.common import cpu_flags, ensure_model, loadavg
from benchmarks.loadgen import chat_stream, node_stream, pct
from benchmarks.service import (
    Sampler,
    UpService,
    count_ready,
    node_model,
    node_model_state,
    status_nodes,
)
from benchmarks.synthetic import ensure_imported, manifest_bytes

PROMPT = "Give me one tip for learning Python."
ROLES = ("prefill", "decode")
MODELS = (("smollm2", "int8"), ("smollm2-bf16", "bf16"), ("synth1g", "synthetic"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the models in turn (each: cold, warm, fresh)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="per-node budget (default: the largest model + half the smallest, weights + KV)")  # fmt: skip
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per model on a node")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--gap-s", type=float, default=1.0, help="pause between requests")
    p.add_argument("--idle-s", type=float, default=8.0, help="[autoscaler] scale_to_zero_after_s")
    p.add_argument("--zero-models", default="smollm2,synth1g", help="models timed from zero replicas")
    p.add_argument("--zero-wait-s", type=float, default=60.0, help="longest wait for a model to reach zero")
    p.add_argument("--no-fresh", action="store_true", help="skip the fresh-process baseline")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--log-dir", default=None, help="service and node logs (default: a temporary folder)")
    p.add_argument("--cache-dir", default=".pdserve/bench/node-cache", help="the nodes' shard cache (kept warm)")
    p.add_argument("--out", default="bench-results/swap.json")


def _models(args) -> tuple[list[str], dict[str, dict]]:
    """Import what is missing; -> (store locations, model -> {kind, weights_bytes, kv_bytes})."""
    from compute.node.config import NodeConfig
    from compute.node.held import estimate_bytes
    from paramstore import ParamStore
    from paramstore.config import store_config

    cfg = store_config(args)
    locations = ensure_model(cfg, "smollm2", "int8")
    ensure_model(cfg, "smollm2-bf16", "bf16")
    ensure_imported(cfg, "synth1g")
    info = {}
    with ParamStore(cfg) as store:
        for name, kind in MODELS:
            m = store.manifest(name)  # what a node will count against its budget (compute/node/held.py)
            w, kv = estimate_bytes(m, "int8", NodeConfig(role="both", internal_token="-", kv_blocks=args.kv_blocks))
            info[name] = {"kind": kind, "stored_bytes": manifest_bytes(m), "weights_bytes": w, "kv_bytes": kv}
    return locations, info


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.kv_blocks < 1 or args.idle_s <= 0:
        raise ValueError("--rounds >= 1, --kv-blocks >= 1, --idle-s > 0")
    locations, info = _models(args)
    names = [m for m, _ in MODELS]
    zero = [m.strip() for m in args.zero_models.split(",") if m.strip()]
    if any(m not in names for m in zero):
        raise ValueError(f"--zero-models: names from {', '.join(names)}")
    sizes = sorted(v["weights_bytes"] + v["kv_bytes"] for v in info.values())
    budget = int(args.memory_gb * 2**30) if args.memory_gb else sizes[-1] + sizes[0] // 2
    if budget >= sum(sizes):
        print(f"note: a budget of {budget / 2**30:.2f} GiB holds every model at once", file=sys.stderr)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-swap-")
    os.makedirs(args.cache_dir, exist_ok=True)
    tables = {"gateway": {"max_running": 64, "max_queue": 256, "queue_timeout_s": 120.0, "models": names},
              "node": {"threads": 1, "kv_blocks": args.kv_blocks, "memory_gb": budget / 2**30,
                       "cache_dir": os.path.abspath(args.cache_dir)},
              "autoscaler": {"tick_s": 0.5, "stable_window_s": 10.0, "panic_window_s": 2.0, "scale_down_delay_s": 5.0,
                             "prefill_min_replicas": 0, "prefill_max_replicas": 1, "decode_min_replicas": 0,
                             "decode_max_replicas": 1, "pool_size": 1, "scale_to_zero_after_s": args.idle_s}}  # fmt: skip
    svc = UpService(names, locations, os.path.join(log_root, "pool"), tables, {r: 1 for r in ROLES})
    report = {"models": info, "memory_budget_bytes": budget, "kv_blocks": args.kv_blocks, "cpus": os.cpu_count(),
              "cpu_flags": cpu_flags(), "load_avg_start": loadavg(), "max_tokens": args.max_tokens}  # fmt: skip
    sampler = None
    try:
        svc.start()
        report["gateway_ready_s"] = round(svc.wait_ready(), 2)
        report["not_set"] = svc.skipped
        t0 = time.monotonic()
        sampler = Sampler(svc, t0, interval_s=0.25, slow_every=2).start()
        visits, fresh, zeros = asyncio.run(_drive(svc, args, names, zero, locations, log_root))
        report["memory"] = _memory(svc, sampler, budget)
    finally:
        if sampler is not None:
            sampler.stop()
        report["up_exit_code"] = svc.stop()
    report.update(_summary(names, visits, fresh, zeros))
    report.update({"visits": visits, "fresh": fresh, "from_zero": zeros, "load_avg_end": loadavg(),
                   "timeline": sampler.compact(every_s=1.0) if sampler else [], "log_dir": log_root})  # fmt: skip
    print(_table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    failed = sum(not v["ok"] for v in visits) + sum(not z["ok"] for z in zeros if z.get("ok") is not None)
    return 1 if failed else 0


async def _ask(client, svc: UpService, model: str, args) -> dict:
    ready = await asyncio.to_thread(lambda: count_ready(svc.status(), model))
    cold = not all(ready.get(r, 0) for r in ROLES)
    s = await chat_stream(client, svc.url, model, args.prompt, args.max_tokens)
    st = await asyncio.to_thread(svc.status)
    load_s = {n["role"]: node_model(n.get("load"), model).get("ready_s") for n in status_nodes(st)
              if node_model(n.get("load"), model)}  # fmt: skip
    return {"model": model, "cold": cold, "ok": s.ok, "ttft_s": None if s.ttft is None else round(s.ttft, 3),
            "node_load_s": load_s, "error": s.error or None}  # fmt: skip


async def _drive(svc, args, names, zero, locations, log_root):
    import httpx

    visits, fresh, zeros = [], [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for m in names:  # warm-up: node cache, page cache, the gateway's text bundles
            w = await _ask(client, svc, m, args)
            print(f"warm-up {m}: {w}", file=sys.stderr, flush=True)
        for rnd in range(args.rounds):
            for m in names:
                for n in (1, 2):
                    v = {**await _ask(client, svc, m, args), "round": rnd, "request": n}
                    visits.append(v)
                    print(f"round {rnd} {m} #{n}: {'cold' if v['cold'] else 'warm'} TTFT {v['ttft_s']} s"
                          f"{' ' + v['error'] if v['error'] else ''}", file=sys.stderr, flush=True)  # fmt: skip
                    await asyncio.sleep(args.gap_s)
                if not args.no_fresh:
                    f = await asyncio.to_thread(_fresh, svc, args, m, locations, log_root)
                    fresh.append({**f, "round": rnd})
                    print(f"round {rnd} {m}: fresh process -> first token {f['first_token_s']} s", file=sys.stderr)
        for m in zero:
            z = {"model": m, "ok": None, "ttft_s": None}
            try:
                z["waited_s"] = round(await asyncio.to_thread(_wait_zero, svc, names, args.zero_wait_s), 2)
            except TimeoutError as e:
                z["error"] = f"not at zero: {str(e)[:160]}"
                zeros.append(z)
                print(f"from zero {m}: {z['error']}", file=sys.stderr)
                continue
            z.update(await _ask(client, svc, m, args))
            zeros.append(z)
            print(f"from zero {m}: TTFT {z['ttft_s']} s (waited {z['waited_s']} s for zero)", file=sys.stderr)
    return visits, fresh, zeros


def _wait_zero(svc: UpService, names: list[str], timeout_s: float) -> float:
    """Wait until no registered node holds any of the models; -> seconds waited."""

    def none_held(st) -> bool:
        return all(node_model_state(n.get("load"), m) is None for n in status_nodes(st) for m in names)

    return svc.wait_for(none_held, timeout_s, "every model at zero replicas")


def _fresh(svc: UpService, args, model: str, locations: list[str], log_root: str) -> dict:
    """A fresh `pdserve node --role both --model M`: spawn -> /ready -> first token of the same chat, direct."""
    import httpx

    from benchmarks.gateway import chat_ids
    from compute.node.launcher import Services

    ids = chat_ids(locations, model, args.prompt)
    services = Services(locations, model, os.path.join(log_root, "fresh"), token=svc.token)
    os.makedirs(services.log_dir, exist_ok=True)
    extra = ("--cache-dir", os.path.abspath(args.cache_dir))
    t0 = time.monotonic()
    try:
        node = services.node("both", threads=1, kv_blocks=args.kv_blocks, extra=extra)
        node.wait_ready(timeout=240)
        ready_s = time.monotonic() - t0

        async def one():
            async with httpx.AsyncClient(timeout=120) as c:
                return await node_stream(c, node.url, svc.token, ids, args.max_tokens)

        s = asyncio.run(one())
        done = None if s.ttft is None else round(ready_s + s.ttft, 3)
        return {"model": model, "ok": s.ok, "ready_s": round(ready_s, 3), "ttft_s": s.ttft and round(s.ttft, 3),
                "first_token_s": done, "error": s.error or None}  # fmt: skip
    except (RuntimeError, TimeoutError) as e:
        return {"model": model, "ok": False, "first_token_s": None, "error": str(e)[:300]}
    finally:
        services.stop_all()


def _memory(svc: UpService, sampler: Sampler, budget: int) -> list[dict]:
    """Per node process: its budget, the most it reported using, RSS in its first sample and peak RSS."""
    reported: dict[str, dict] = {}
    for row in sampler.rows:
        for url, n in row["nodes"].items():
            r = reported.setdefault(url, {"role": n["role"], "used_max": 0, "budget": n.get("memory_budget_bytes")})
            r["used_max"] = max(r["used_max"], n.get("memory_used_bytes") or 0)
    out = []
    for key, m in svc.memory().items():
        r = reported.get(m["url"], {})
        growth = m["peak_rss_bytes"] - m["first_rss_bytes"]
        out.append({"node": key, "role": r.get("role"), "budget_bytes": r.get("budget") or budget,
                    "reported_used_max_bytes": r.get("used_max"), "first_rss_bytes": m["first_rss_bytes"],
                    "peak_rss_bytes": m["peak_rss_bytes"], "rss_growth_bytes": growth,
                    "within_budget": growth <= (r.get("budget") or budget)})  # fmt: skip
    return out


def _summary(names, visits, fresh, zeros) -> dict:
    rows = {}
    for m in names:
        cold = [v["ttft_s"] for v in visits if v["model"] == m and v["cold"] and v["ok"]]
        warm = [v["ttft_s"] for v in visits if v["model"] == m and not v["cold"] and v["ok"]]
        fr = [f["first_token_s"] for f in fresh if f["model"] == m and f["ok"]]
        c50, f50 = pct(cold, 50), pct(fr, 50)
        rows[m] = {"cold_requests": len(cold), "cold_ttft_p50_s": c50, "cold_ttft_max_s": max(cold) if cold else None,
                   "warm_ttft_p50_s": pct(warm, 50), "fresh_first_token_p50_s": f50,
                   "fresh_over_cold": round(f50 / c50, 2) if c50 and f50 else None,
                   "from_zero_ttft_s": [z["ttft_s"] for z in zeros if z["model"] == m]}  # fmt: skip
    return {"summary": rows, "requests_failed": sum(not v["ok"] for v in visits)}


def _table(r: dict) -> str:
    f = lambda x, u="": "-" if x is None else f"{x}{u}"
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
    lines = [(f"budget per node {gib(r['memory_budget_bytes'])} (weights + KV), {r['kv_blocks']} KV blocks per model; "
              f"CPU flags: {' '.join(r['cpu_flags']) or '-'}; load avg {f(r['load_avg_start'])}"), ""]  # fmt: skip
    head = (f"{'model':<14} {'weights':>10} {'cold TTFT p50':>14} {'cold max':>9} {'warm TTFT':>10} "
            f"{'fresh proc->1st tok':>20} {'fresh/cold':>10} {'from zero':>12}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for m, s in r["summary"].items():
        z = ", ".join(f(x, " s") for x in s["from_zero_ttft_s"]) or "-"
        lines.append(f"{m:<14} {gib(r['models'][m]['weights_bytes']):>10} {f(s['cold_ttft_p50_s'], ' s'):>14} "
                     f"{f(s['cold_ttft_max_s'], ' s'):>9} {f(s['warm_ttft_p50_s'], ' s'):>10} "
                     f"{f(s['fresh_first_token_p50_s'], ' s'):>20} {f(s['fresh_over_cold'], 'x'):>10} {z:>12}")  # fmt: skip
    lines += ["", (f"{'node':<34} {'role':<8} {'budget':>10} {'reported max':>13} {'standby RSS':>12} "
                   f"{'peak RSS':>10} {'growth':>10} {'within':>7}")]  # fmt: skip
    for m in r.get("memory", []):
        lines.append(f"{m['node']:<34} {f(m['role']):<8} {gib(m['budget_bytes']):>10} "
                     f"{gib(m['reported_used_max_bytes']):>13} {gib(m['first_rss_bytes']):>12} "
                     f"{gib(m['peak_rss_bytes']):>10} {gib(m['rss_growth_bytes']):>10} {m['within_budget']!s:>7}")  # fmt: skip
    lines.append(f"requests failed: {r['requests_failed']} of {len(r['visits'])}")
    return "\n".join(lines)
