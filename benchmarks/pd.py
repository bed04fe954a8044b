"""`pdserve bench pd`: KV transfer vs prefill time, and colocated vs disaggregated serving.

    pdserve bench pd [--store URL ...] [--model smollm2] [--quick] [--out bench-results/pd.json]

1. KV transfer of a 512-token prompt (SmolLM2 layout, the node's cache dtype) between two
   processes, via ``benchmarks.kv_transfer.bench_transfer``: ``nixl`` / ``tcp`` beside
   ``memcpy`` and a raw NIXL READ of one buffer of the same size; plus the 512-token prefill
   time of a real prefill node (``POST /internal/prefill``, max_tokens 2, median) and a real
   prefill -> decode handoff (prefill, then ``/internal/decode`` to its one-token end), so
   transfer time / prefill time is shown (target <= 10%).
2. Mixed workload at the same total CPU, each configuration behind its own gateway:
   colocated (one ``both`` node, ``--threads 2``) vs disaggregated (one ``prefill`` +
   one ``decode`` node, ``--threads 1`` each, nixl, tcp if nixl does not come up).
   The workload is fixed by ``--seed`` and identical for both: ``--streams`` closed-loop chat
   streams (short prompts, ``--stream-tokens`` new tokens each, ignore_eos) run for
   ``--duration`` seconds while long prompts (``--long-min``..``--long-max`` tokens, 8 new
   tokens) arrive about every ``--long-every`` seconds. Measured at the client through the
   gateway's streaming API: TTFT (request sent -> first SSE chunk), TPOT ((last - first) /
   (n - 1)) and inter-chunk gaps (ITL), p50/p99, per class; total generated tokens/s.

Every process started here is stopped on the way out (try/finally). If the store has no
``--model`` it is imported from the real GGUF first (once; the default scratch store under
``.pdserve/bench-pd-store`` is kept for the next run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time

from benchmarks.common import cpu_seconds, ensure_model
from benchmarks.mixed_workload import (
    long_prompt,
    mixed_table,
    run_mixed,
    summary,
    workload,
)
from compute.engine.sampling import SamplingParams
from compute.node import protocol as P
from compute.node.launcher import ServiceProc, Services

SCRATCH_STORE = os.path.join(".pdserve", "bench-pd-store")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", metavar="URL",
                   help=f"store location (repeat); default: a scratch local store in {SCRATCH_STORE}")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="int8 model in the store (imported from the GGUF if absent)")
    p.add_argument("--transport", default="nixl", choices=("nixl", "tcp"), help="disaggregated KV transport")
    p.add_argument("--quick", action="store_true", help="shorter run: 20 s per configuration, fewer reps")
    p.add_argument("--duration", type=float, default=None, help="seconds of workload per configuration (default 75)")
    p.add_argument("--streams", type=int, default=6, help="concurrent short chat streams")
    p.add_argument("--stream-tokens", type=int, default=64,
                   help="mean new tokens per short stream request (each drawn from 0.5x..1.5x)")  # fmt: skip
    p.add_argument("--long-every", type=float, default=None,
                   help="mean seconds between long prompts (default: 2, or more when the prefill node, measured "
                        "first, would be over half busy with them)")  # fmt: skip
    p.add_argument("--long-min", type=int, default=400)
    p.add_argument("--long-max", type=int, default=500)
    p.add_argument("--long-new", type=int, default=8, help="new tokens per long prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-reps", type=int, default=None, help="KV transfer repetitions (default 7, quick 3)")
    p.add_argument("--prefill-reps", type=int, default=None, help="512-token prefill repetitions (default 3, quick 2)")
    p.add_argument("--kv-dtypes", default="float32", help="comma-separated KV dtypes for the transfer table")
    p.add_argument("--order", default="disaggregated,colocated", help="order of the two configurations")
    p.add_argument("--skip-mixed", action="store_true", help="only the KV transfer / prefill table")
    p.add_argument("--logs", default=None, help="directory for the service logs (default: a temp dir)")
    p.add_argument("--out", default="bench-results/pd.json")




# --- part 1: KV transfer and prefill time ---------------------------------------------------------------------


def _handoff_times(prefill: ServiceProc, decode: ServiceProc, auth, prompt: list[int], reps: int) -> list[dict]:
    """Real prefill -> decode: /internal/prefill (max_tokens 2), then /internal/decode to its last token."""
    from compute.node.client import SyncNodeClient

    out = []
    with SyncNodeClient(None, timeout_s=120, auth=auth) as c:
        for i in range(reps + 1):
            rid = f"bench-handoff-{i}-{secrets.token_hex(4)}"
            t0 = time.perf_counter()
            msg = P.GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0))
            first = c.prefill(prefill.url, msg)
            t1 = time.perf_counter()
            if not first.kv:
                raise RuntimeError(f"prefill returned no KV handle: {first}")
            dmsg = P.DecodeRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                   first_token_id=first.token_ids[-1], kv=first.kv)  # fmt: skip
            reason = next(line.finish_reason for line in c.decode(decode.url, dmsg) if line.finish_reason)
            t2 = time.perf_counter()
            if reason not in ("length", "stop"):
                raise RuntimeError(f"decode ended with {reason!r}")
            if i:
                out.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
    return out


def _transfer_table(tr: dict, prefill_s: float, handoff: list[dict] | None, generate_s: float | None) -> str:
    lines = [(f"KV transfer of a {tr['num_tokens']}-token prompt (SmolLM2 layout), two processes, median of "
              f"{tr['reps']}; prefill = real prefill node, 1 thread, median"),
             (f"{'dtype':<8} {'method':<15} {'MB':>6} {'ms':>7} {'GB/s':>6} {'x raw nixl':>10} {'x memcpy':>8} "
              f"{'% prefill':>9}")]  # fmt: skip
    for dt, r in tr["results"].items():
        mem = r["rows"]["memcpy"]["seconds"]
        for name, row in r["rows"].items():
            lines.append(f"{dt:<8} {name:<15} {row['bytes'] / 1e6:>6.2f} {row['seconds'] * 1e3:>7.2f} "
                         f"{row['gbps']:>6.2f} {row['vs_raw_nixl']:>10.2f} {mem / row['seconds']:>8.3f} "
                         f"{100 * row['seconds'] / prefill_s:>8.1f}%")  # fmt: skip
    lines.append(f"prefill of {tr['num_tokens']} tokens (POST /internal/prefill, prefill node --threads 1): "
                 f"{prefill_s * 1e3:.0f} ms")  # fmt: skip
    if generate_s is not None:
        lines.append(f"prefill of {tr['num_tokens']} tokens on the colocated node (--threads 2, /internal/generate "
                     f"max_tokens 1): {generate_s * 1e3:.0f} ms")  # fmt: skip
    if handoff:
        d = statistics.median(h["decode_s"] for h in handoff)
        lines.append(f"real handoff: /internal/decode to its 1-token end (KV pull + activate + 1 decode step + HTTP): "
                     f"{d * 1e3:.1f} ms = {100 * d / prefill_s:.1f}% of the prefill")  # fmt: skip
    return "\n".join(lines)


def _analysis(result: dict) -> str:
    res = result["mixed"]
    c, d = res["colocated"], res["disaggregated"]

    def r(kind, k):
        a, b = c[kind][k], d[kind][k]
        return b / a if a and b else float("nan")

    p1 = result["prefill_512"]["seconds"]
    p2 = result.get("colocated_prefill_512", {}).get("seconds")
    tp = d["tokens_per_s"] / max(c["tokens_per_s"], 1e-9)
    lines = ["Analysis (one run; disagg / colocated, < 1 = disaggregated better):"]
    lines.append(f"- short streams: TPOT p99 x{r('short', 'tpot_p99'):.2f}, ITL p99 x{r('short', 'itl_p99'):.2f}, "
                 f"TTFT p50 x{r('short', 'ttft_p50'):.2f} / p99 x{r('short', 'ttft_p99'):.2f}. "
                 "The seeds' claim is P99 down ~47% (x0.53).")  # fmt: skip
    lines.append(f"- long prompts: TTFT p50 x{r('long', 'ttft_p50'):.2f} / p99 x{r('long', 'ttft_p99'):.2f}, "
                 f"TPOT p99 x{r('long', 'tpot_p99'):.2f}; all generated tokens/s x{tp:.2f}.")  # fmt: skip
    lines.append("- colocated, a long prompt is one prefill step (<= --max-batched-tokens 512) shared with the "
                 "decode batch: every running stream stalls for that whole prefill (the ITL p99 above); the "
                 "decode node never runs prefills, so disaggregation removes that tail.")  # fmt: skip
    lines.append("- the price: every request, the short chats too, queues on the single 1-thread prefill node "
                 "(behind a whole long prefill when one is running), so short TTFT rises; the KV handoff "
                 "delays the second token (a few % of a prefill, table 1).")
    if p2:
        sp = p1 / p2
        why = ("a 2-thread pool scales poorly on 2 cores shared with the gateway, this client and other jobs, "
               "which favours two 1-thread processes" if sp < 1.6 else
               "more than 2x: the box's load changed between the two measurements" if sp > 2.4 else
               "about the 2x the colocated node's extra thread should give")  # fmt: skip
        lines.append(f"- same total CPU = 1 thread per role instead of 2: a 512-token prefill took {p1:.2f} s on "
                     f"1 thread vs {p2:.2f} s on 2 (x{sp:.2f}; {why}).")  # fmt: skip
    lines.append(f"- CPU the nodes got during the run: colocated {c['node_cpu_cores']:.2f} cores, disaggregated "
                 f"{d['node_cpu_cores']:.2f} (prefill {d['node_cpu_by_role'].get('prefill', 0):.2f} + decode "
                 f"{d['node_cpu_by_role'].get('decode', 0):.2f}) of 2.")  # fmt: skip
    lines.append(f"- long prompts arrived every ~{result['workload']['long_every_s']:g} s "
                 f"({result['workload']['long_prompts']} in the run): 2 s would keep the 1-thread prefill node "
                 "over 100% busy here, and p99 would measure the run's length. Few long samples: their p99 is "
                 "~ the max. Load average (above) shows the box was shared: absolute numbers are noisy.")  # fmt: skip
    return "\n".join(lines)



# --- main -------------------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    from benchmarks.kv_transfer import _METHODS, bench_transfer

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    duration = args.duration or (20.0 if args.quick else 75.0)
    treps = args.transfer_reps or (3 if args.quick else 7)
    preps = args.prefill_reps or (2 if args.quick else 3)
    t_begin = time.perf_counter()
    from benchmarks.common import bundle as model_bundle
    from paramstore import StoreConfig

    cfg = StoreConfig(locations=args.store) if args.store else StoreConfig.local_default(SCRATCH_STORE)
    store = ensure_model(cfg, args.model)
    bundle = model_bundle(store, args.model)
    log_dir = args.logs or tempfile.mkdtemp(prefix="pdserve-bench-pd-")
    os.makedirs(log_dir, exist_ok=True)
    result: dict = {"bench": "pd", "model": args.model, "store": store[0], "logs": log_dir, "quick": args.quick,
                    "args": {k: v for k, v in vars(args).items() if k not in ("store",)}}  # fmt: skip

    # 1. KV transfer between two processes
    print("KV transfer (two processes) ...", file=sys.stderr, flush=True)
    methods = {k: _METHODS[k] for k in ("nixl", "nixl scattered", "tcp", "tcp scattered")}
    tr = bench_transfer(512, dtypes=tuple(args.kv_dtypes.split(",")), reps=treps, methods=methods, echo=False)
    result["transfer"] = tr
    prompt512 = long_prompt(random.Random(args.seed + 1), bundle, 512)

    svc = Services(store, args.model, log_dir)
    try:
        configs = {}
        # disaggregated pair first comes up (it also gives the prefill-time measurement)
        transport, pair, handoff, prefill_s = None, None, None, None
        for tp in dict.fromkeys([args.transport, "tcp"]):
            print(f"starting prefill + decode nodes ({tp}, 1 thread each) ...", file=sys.stderr, flush=True)
            pre, dec = svc.node("prefill", 1, tp), svc.node("decode", 1, tp)
            try:
                pre.wait_ready()
                dec.wait_ready()
                handoff = _handoff_times(pre, dec, svc.auth, prompt512, preps)
            except Exception as e:  # fall back to tcp once
                print(f"disaggregated pair over {tp} failed: {e}", file=sys.stderr)
                svc.stop([pre, dec])
                if tp == "tcp":
                    raise
                continue
            transport, pair = tp, (pre, dec)
            times = [h["prefill_s"] for h in handoff]
            prefill_s = statistics.median(times)
            result["prefill_512"] = {"seconds": prefill_s, "samples": times, "node_threads": 1}
            result["handoff_512"] = {"transport": tp, "samples": handoff,
                                     "decode_s_median": statistics.median(h["decode_s"] for h in handoff)}  # fmt: skip
            break
        for r in tr["results"].values():
            for row in r["rows"].values():
                row["vs_prefill"] = row["seconds"] / prefill_s
        result["transfer_meets_10pct"] = all(r["rows"][m]["vs_prefill"] <= 0.10 for r in tr["results"].values()
                                             for m in ("nixl", "tcp"))  # fmt: skip

        if args.skip_mixed:
            svc.stop(list(pair))
            print(_transfer_table(tr, prefill_s, handoff, None))
        else:
            # 2 s arrivals, unless that would keep the 1-thread prefill node over half busy with long
            # prompts alone: then the queue grows for the whole run and p99 measures the run's length
            mean_len = (args.long_min + args.long_max) / 2
            auto_every = max(2.0, 2.0 * prefill_s * mean_len / 512)
            if args.long_every is None:
                args.long_every = round(auto_every, 1)
                if auto_every > 2.0:
                    print(f"long prompts every ~{args.long_every:g} s, not 2 s: a {mean_len:.0f}-token prefill takes "
                          f"~{prefill_s * mean_len / 512:.1f} s on the 1-thread prefill node here", file=sys.stderr)  # fmt: skip
            wl = workload(args, bundle, duration)
            result["workload"] = {"duration_s": duration, "streams": args.streams, "stream_tokens": args.stream_tokens,
                                  "long_prompts": len(wl["longs"]),
                                  "long_tokens": [len(p) for _, p in wl["longs"]], "long_new": args.long_new,
                                  "long_every_s": args.long_every, "long_every_auto_s": auto_every,
                                  "seed": args.seed}  # fmt: skip
            generate_s = None
            order = [o.strip() for o in args.order.split(",")]
            for name in order:
                if name == "disaggregated":
                    if pair is None:
                        pair = (svc.node("prefill", 1, transport), svc.node("decode", 1, transport))
                        for n in pair:
                            n.wait_ready()
                    nodes = [("prefill", pair[0]), ("decode", pair[1])]
                else:
                    if pair is not None:  # never two configurations' processes at once
                        svc.stop(list(pair))
                        pair = None
                    print("starting the colocated node (both, 2 threads) ...", file=sys.stderr, flush=True)
                    both = svc.node("both", 2)
                    both.wait_ready()
                    generate_s = _generate_first(both, svc.auth, prompt512, preps)
                    result["colocated_prefill_512"] = {"seconds": generate_s, "node_threads": 2}
                    nodes = [("both", both)]
                gw = svc.gateway(nodes).wait_ready()
                print(f"{name}: {duration:g} s of mixed workload ...", file=sys.stderr, flush=True)
                cpu0 = {role: cpu_seconds(n.p.pid) for role, n in nodes}
                run = asyncio.run(run_mixed(gw.url, wl, args, duration, args.model))
                configs[name] = summary(run)
                by_role = {role: (cpu_seconds(n.p.pid) - cpu0[role]) / run["wall_s"] for role, n in nodes}
                configs[name].update(node_cpu_by_role=by_role, node_cpu_cores=sum(by_role.values()))
                configs[name]["records"] = run["records"]
                svc.stop([gw] + [n for _, n in nodes])
                pair = None
            result["mixed"] = {"transport": transport, **{k: {kk: vv for kk, vv in v.items() if kk != "records"}
                                                          for k, v in configs.items()}}  # fmt: skip
            result["mixed_records"] = {k: v["records"] for k, v in configs.items()}
            print(_transfer_table(tr, prefill_s, handoff, generate_s))
            print()
            print(mixed_table(result["mixed"], args, duration))
            print()
            print(_analysis(result))
    finally:
        svc.stop_all()
    result["total_s"] = time.perf_counter() - t_begin
    print(f"\n(total {result['total_s']:.0f} s; service logs in {log_dir})")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def _generate_first(node: ServiceProc, auth, prompt: list[int], reps: int) -> float:
    """512-token prefill on a `both` node: /internal/generate with max_tokens 1, to its only line."""
    from compute.node.client import SyncNodeClient

    times = []
    with SyncNodeClient(None, timeout_s=120, auth=auth) as c:
        for i in range(reps + 1):
            msg = P.GenerateRequest(f"bench-gen-{i}-{secrets.token_hex(4)}", prompt,
                                    SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
            t0 = time.perf_counter()
            next(line for line in c.generate(node.url, msg) if line.finish_reason)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)
