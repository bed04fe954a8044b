"""`pdserve bench swap`: many models on one small pool — cold-model first token vs a fresh process, and from zero.

    pdserve bench swap [--store URL ...] [--rounds 2] [--memory-gb auto] [--kv-blocks 256]
                       [--out bench-results/swap.json]

Models in the store (imported once, cached): SmolLM2 as int8 (``smollm2``) and as bf16
(``smollm2-bf16``) from the real GGUF, and a synthetic Llama-shaped model of random weights, ~1 GiB
as int8 (``synth1g``, benchmarks/synthetic.py). Each phase is the real `pdserve up --model ...
--prefill 1 --decode 1 --autoscale` (benchmarks/service.py), every node with a memory budget
(weights + KV) that holds the largest model but not all of them at once, the nodes' shard cache
in ``--cache-dir`` (kept warm across runs).

Phase ``swap``: exactly 1 + 1 runtimes (at most 1 replica per role: the pool keeps the plan's 1 + 1
up and never more than max_replicas, pool_size 1 within that), so serving a model evicts another. Warm-up: each model once (not
counted) -> ``--rounds`` rounds, each model in turn: request 1 (*cold* if the model is not ready on
a node of each role at that moment: held by the activator while the pool injects it, evicting the
least recently used idle model) and request 2 (warm: the control), then — interleaved — a fresh
`pdserve node --role both --model M` process, timed from spawn to the first token of the same
request sent to it directly (what scaling up meant before the pool; no gateway, no KV handoff: it
favours the baseline).

Phase ``zero``: pool_size 1 (a standby runtime per role stays up while every model is at zero) and
``scale_to_zero_after_s`` = ``--idle-s``: after a warm-up, for each of ``--zero-models``: wait
until no node holds any model and a standby runtime per role is up, then one request (first token
from zero replicas).

Reported (table, JSON): per model, cold-request TTFT median/max and the nodes' own load time (their
/load ``ready_s``), warm TTFT, fresh process -> first token median and the ratio; from zero -> first
token; per node process its memory budget, the most it reported using, its RSS in standby (the
least it reported) and its peak RSS (VmHWM from /proc) — the growth should stay within the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import cpu_flags, ensure_model, loadavg
from benchmarks.loadgen import chat_stream, node_stream
from benchmarks.service import (
    Sampler,
    UpService,
    count_ready,
    count_standby,
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
    from compute.modeling.loader import transient_bytes
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
            info[name] = {"kind": kind, "stored_bytes": manifest_bytes(m), "weights_bytes": w, "kv_bytes": kv,
                          "load_transient_bytes": transient_bytes(m, 1)}  # the least a load reserves on top
    return locations, info


def _tables(args, names: list[str], budget: int, pool_size: int, idle_s: float, cooldown_s: float) -> dict:
    return {"gateway": {"max_running": 64, "max_queue": 256, "queue_timeout_s": 120.0, "models": names},
            "node": {"threads": 1, "kv_blocks": args.kv_blocks, "memory_gb": budget / 2**30,
                     "cache_dir": os.path.abspath(args.cache_dir)},
            "autoscaler": {"tick_s": 0.5, "stable_window_s": 10.0, "panic_window_s": 2.0, "scale_down_delay_s": cooldown_s,
                           "prefill_min_replicas": 0, "prefill_max_replicas": 1, "decode_min_replicas": 0,
                           "decode_max_replicas": 1, "pool_size": pool_size, "scale_to_zero_after_s": idle_s}}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.kv_blocks < 1 or args.idle_s <= 0:
        raise ValueError("--rounds >= 1, --kv-blocks >= 1, --idle-s > 0")
    names = [m for m, _ in MODELS]
    zero = [m.strip() for m in args.zero_models.split(",") if m.strip()]
    if any(m not in names for m in zero):
        raise ValueError(f"--zero-models: names from {', '.join(names)}")
    locations, info = _models(args)
    sizes = sorted(v["weights_bytes"] + v["kv_bytes"] + v["load_transient_bytes"] for v in info.values())
    budget = int(args.memory_gb * 2**30) if args.memory_gb else sizes[-1] + sizes[0] // 2
    if budget >= sum(sizes):
        print(f"note: a budget of {budget / 2**30:.2f} GiB holds every model at once", file=sys.stderr)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-swap-")
    os.makedirs(args.cache_dir, exist_ok=True)
    report = {"models": info, "memory_budget_bytes": budget, "kv_blocks": args.kv_blocks, "cpus": os.cpu_count(),
              "cpu_flags": cpu_flags(), "load_avg_start": loadavg(), "max_tokens": args.max_tokens}  # fmt: skip
    # swap: 1 + 1 runtimes exactly (at most 1 per role: the pool's runtimes stay within max_replicas, the
    # plan's 1 + 1 kept up; pool_size 1 fits inside that cap), never idle to 0; a 30 s cooldown
    swap = _phase(args, "swap", names, locations, log_root, _tables(args, names, budget, 1, 0.0, 30.0),
                  lambda svc: _swap(svc, args, names, locations, log_root))  # fmt: skip
    # from zero: a standby runtime per role kept while every model is at zero (pool_size 1)
    zeros = _phase(args, "zero", zero, locations, log_root, _tables(args, zero, budget, 1, args.idle_s, 10.0),
                   lambda svc: _from_zero(svc, args, zero))  # fmt: skip
    visits, fresh = swap["result"]
    report.update(_summary(names, visits, fresh, zeros["result"]))
    report.update({"visits": visits, "fresh": fresh, "from_zero": zeros["result"], "load_avg_end": loadavg(),
                   "memory": swap["memory"] + zeros["memory"], "phases": {k: {x: v for x, v in ph.items() if x != "result"}
                                                                       for k, ph in (("swap", swap), ("zero", zeros))},
                   "runtime_processes": {"swap": len(swap["memory"]), "zero": len(zeros["memory"])},
                   "log_dir": log_root})  # fmt: skip
    print(_table(report))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    failed = sum(not v["ok"] for v in visits) + sum(not z["ok"] for z in zeros["result"] if z.get("ok") is not None)
    return 1 if failed else 0


def _phase(args, name: str, models: list[str], locations, log_root: str, tables: dict, body) -> dict:
    """One `pdserve up --model ... --prefill 1 --decode 1 --autoscale`, watched, running `body(svc)` (async)."""
    svc = UpService(models, locations, os.path.join(log_root, name), tables, {r: 1 for r in ROLES})
    out: dict = {"config": tables}
    sampler = None
    try:
        svc.start()
        out["gateway_ready_s"] = round(svc.wait_ready(), 2)
        out["not_set"] = svc.skipped
        sampler = Sampler(svc, time.monotonic(), interval_s=0.25, slow_every=2).start()
        out["result"] = asyncio.run(body(svc))
    finally:
        if sampler is not None:
            sampler.stop()
        out["up_exit_code"] = svc.stop()
    out["memory"] = _memory(svc, sampler, int(tables["node"]["memory_gb"] * 2**30), name)
    out["timeline"] = sampler.compact(every_s=1.0)
    return out


async def _ask(client, svc: UpService, model: str, args) -> dict:
    ready = await asyncio.to_thread(lambda: count_ready(svc.status(), model))
    cold = not all(ready.get(r, 0) for r in ROLES)
    s = await chat_stream(client, svc.url, model, args.prompt, args.max_tokens)
    st = await asyncio.to_thread(svc.status)
    load_s = {n["role"]: node_model(n.get("load"), model).get("ready_s") for n in status_nodes(st)
              if node_model(n.get("load"), model)}  # fmt: skip
    return {"model": model, "cold": cold, "ok": s.ok, "ttft_s": None if s.ttft is None else round(s.ttft, 3),
            "node_load_s": load_s, "error": s.error or None}  # fmt: skip


async def _swap(svc, args, names, locations, log_root):
    """Warm-up, then rounds of (cold, warm, fresh process) per model; -> (visits, fresh)."""
    import httpx

    visits, fresh = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for m in names:  # warm-up: node cache, page cache, the gateway's text bundles
            w = await _ask(client, svc, m, args)
            print(f"warm-up {m}: TTFT {w['ttft_s']} s {w['error'] or ''}", file=sys.stderr, flush=True)
        for rnd in range(args.rounds):
            for m in names:
                for n in (1, 2):
                    v = {**await _ask(client, svc, m, args), "round": rnd, "request": n}
                    visits.append(v)
                    print(f"round {rnd} {m} #{n}: {'cold' if v['cold'] else 'warm'} TTFT {v['ttft_s']} s "
                          f"(node load {v['node_load_s']}) {v['error'] or ''}", file=sys.stderr, flush=True)  # fmt: skip
                    await asyncio.sleep(args.gap_s)
                if not args.no_fresh:
                    f = await asyncio.to_thread(_fresh, svc, args, m, locations, log_root)
                    fresh.append({**f, "round": rnd})
                    print(f"round {rnd} {m}: fresh process -> first token {f['first_token_s']} s", file=sys.stderr)
    return visits, fresh


async def _from_zero(svc, args, zero):
    """Each model once from zero replicas (every model idle past scale_to_zero_after_s, standby runtimes up)."""
    import httpx

    zeros = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        for m in zero:  # warm-up: placed at start; the node cache holds it
            await _ask(client, svc, m, args)
        for m in zero:
            z = {"model": m, "ok": None, "ttft_s": None}
            try:
                z["waited_s"] = round(await asyncio.to_thread(_wait_zero, svc, zero, args.zero_wait_s), 2)
            except TimeoutError as e:
                z["error"] = f"not at zero: {str(e)[:160]}"
                zeros.append(z)
                print(f"from zero {m}: {z['error']}", file=sys.stderr)
                continue
            z.update(await _ask(client, svc, m, args))
            zeros.append(z)
            print(f"from zero {m}: TTFT {z['ttft_s']} s (node load {z['node_load_s']}; waited {z['waited_s']} s "
                  f"for zero)", file=sys.stderr)  # fmt: skip
    return zeros


def _wait_zero(svc: UpService, names: list[str], timeout_s: float) -> float:
    """Wait until no registered node holds any of the models; -> seconds waited."""

    def none_held(st) -> bool:
        standby = count_standby(st)
        return (all(standby.get(r, 0) for r in ROLES)
                and all(node_model_state(n.get("load"), m) is None for n in status_nodes(st) for m in names))  # fmt: skip

    return svc.wait_for(none_held, timeout_s, "every model at zero replicas, a standby runtime per role")


def _fresh(svc: UpService, args, model: str, locations: list[str], log_root: str) -> dict:
    """A fresh `pdserve node --role both --model M`: spawn -> /ready -> first token of the same chat, direct."""
    from benchmarks.gateway import chat_ids
    from compute.node.client import AsyncNodeClient
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
            async with AsyncNodeClient(svc.token, timeout_s=120) as nodes:
                return await node_stream(nodes, node.url, ids, args.max_tokens)

        s = asyncio.run(one())
        done = None if s.ttft is None else round(ready_s + s.ttft, 3)
        return {"model": model, "ok": s.ok, "ready_s": round(ready_s, 3), "ttft_s": s.ttft and round(s.ttft, 3),
                "first_token_s": done, "error": s.error or None}  # fmt: skip
    except (RuntimeError, TimeoutError) as e:
        return {"model": model, "ok": False, "first_token_s": None, "error": str(e)[:300]}
    finally:
        services.stop_all()


def _memory(svc: UpService, sampler: Sampler | None, budget: int, phase: str) -> list[dict]:
    """Per node process: its budget, the most it reported using, its RSS in standby (its least reported RSS,
    imports done) and its peak RSS (VmHWM, /proc) — the growth is what its models cost."""
    reported: dict[str, dict] = {}
    for row in sampler.rows if sampler else []:
        for url, n in row["nodes"].items():
            r = reported.setdefault(url, {"role": n["role"], "used_max": 0, "budget": n.get("memory_budget_bytes"),
                                          "rss_min": None})  # fmt: skip
            r["used_max"] = max(r["used_max"], n.get("memory_used_bytes") or 0)
            if n.get("rss_bytes"):
                r["rss_min"] = min(r["rss_min"] or n["rss_bytes"], n["rss_bytes"])
    out = []
    for key, m in svc.memory().items():
        r = reported.get(m["url"], {})
        base = r.get("rss_min") or m["first_rss_bytes"]
        growth, cap = m["peak_rss_bytes"] - base, r.get("budget") or budget
        out.append({"phase": phase, "node": key, "role": r.get("role"), "budget_bytes": cap,
                    "reported_used_max_bytes": r.get("used_max"), "standby_rss_bytes": base,
                    "peak_rss_bytes": m["peak_rss_bytes"], "rss_growth_bytes": growth,
                    "within_budget": growth <= cap})  # fmt: skip
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _summary(names, visits, fresh, zeros) -> dict:
    rows = {}
    for m in names:
        cold = [v["ttft_s"] for v in visits if v["model"] == m and v["cold"] and v["ok"]]
        warm = [v["ttft_s"] for v in visits if v["model"] == m and not v["cold"] and v["ok"]]
        fr = [f["first_token_s"] for f in fresh if f["model"] == m and f["ok"]]
        loads = [max(v["node_load_s"].values()) for v in visits
                 if v["model"] == m and v["cold"] and v["ok"] and v.get("node_load_s") and all(v["node_load_s"].values())]
        c50, f50 = _median(cold), _median(fr)
        rows[m] = {"cold_requests": len(cold), "cold_ttft_p50_s": c50, "cold_ttft_max_s": max(cold) if cold else None,
                   "cold_node_load_p50_s": _median(loads), "cold_ttft_s": cold, "fresh_first_token_s": fr,
                   "warm_ttft_p50_s": _median(warm), "fresh_first_token_p50_s": f50,
                   "fresh_over_cold": round(f50 / c50, 2) if c50 and f50 else None,
                   "from_zero_ttft_s": [z["ttft_s"] for z in zeros if z["model"] == m]}  # fmt: skip
    return {"summary": rows, "requests_failed": sum(not v["ok"] for v in visits)}


def _table(r: dict) -> str:
    f = lambda x, u="": "-" if x is None else f"{x}{u}"
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
    lines = [(f"budget per node {gib(r['memory_budget_bytes'])} (weights + KV), {r['kv_blocks']} KV blocks per model; "
              f"CPU flags: {' '.join(r['cpu_flags']) or '-'}; load avg {f(r['load_avg_start'])}"), ""]  # fmt: skip
    head = (f"{'model':<14} {'weights':>10} {'cold TTFT med':>14} {'cold max':>9} {'node load':>10} {'warm TTFT':>10} "
            f"{'fresh proc->1st tok':>20} {'fresh/cold':>10} {'from zero':>12}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for m, s in r["summary"].items():
        z = ", ".join(f(x, " s") for x in s["from_zero_ttft_s"]) or "-"
        lines.append(f"{m:<14} {gib(r['models'][m]['weights_bytes']):>10} {f(s['cold_ttft_p50_s'], ' s'):>14} "
                     f"{f(s['cold_ttft_max_s'], ' s'):>9} {f(s['cold_node_load_p50_s'], ' s'):>10} "
                     f"{f(s['warm_ttft_p50_s'], ' s'):>10} "
                     f"{f(s['fresh_first_token_p50_s'], ' s'):>20} {f(s['fresh_over_cold'], 'x'):>10} {z:>12}")  # fmt: skip
    lines += ["", (f"{'phase':<5} {'node':<12} {'role':<8} {'budget':>10} {'reported max':>13} {'standby RSS':>12} "
                   f"{'peak RSS':>10} {'growth':>10} {'within':>7}")]  # fmt: skip
    for m in r.get("memory", []):
        node = m["node"].rsplit(":", 1)[-1]
        lines.append(f"{m['phase']:<5} {node:<12} {f(m['role']):<8} {gib(m['budget_bytes']):>10} "
                     f"{gib(m['reported_used_max_bytes']):>13} {gib(m['standby_rss_bytes']):>12} "
                     f"{gib(m['peak_rss_bytes']):>10} {gib(m['rss_growth_bytes']):>10} {m['within_budget']!s:>7}")  # fmt: skip
    lines.append(f"requests failed: {r['requests_failed']} of {len(r['visits'])}")
    return "\n".join(lines)
