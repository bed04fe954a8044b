"""`pdserve bench first-start`: launch -> answer on a machine that has never run pdserve, vs a warm second start.

    pdserve bench first-start [--model smollm2] [--store URL ...] [--rounds 3]
                              [--dispatch native,avx2] [--out bench-results/first_start.json]

What a new user does (`make demo`): `pdserve up`, and `pdserve chat` at once. One round, per dispatch level:
 1. first: a fresh, empty HOME (no kernel table, no shard cache) and no kernel plan for this machine class in
    the store (deleted before the round) -> seconds from spawning `pdserve up` to `pdserve chat`'s answer;
 2. warm: the same, with a HOME whose kernel table holds every shape of the model at the nodes' thread count
    (measured once per dispatch level before the rounds, as a machine that has run pdserve has it) and the
    page cache warm from the round before.
Rounds interleave first and warm, so a noisy neighbour hits both; the table gives medians and their ratio.
``--dispatch avx2`` runs the same under ``ATEN_CPU_CAPABILITY=avx2`` / ``ONEDNN_MAX_CPU_ISA=AVX2``: the
stand-in for an AVX2-only machine (where a kernel measurement took ~72 s). Each process is stopped after
its round; the JSON has every round, the CPU flags and the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

DISPATCH = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
QUESTION = "What is the capital of France?"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--store", action="append", help="store locations (default: a temporary local store)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads-per-node", type=int, default=1)
    p.add_argument("--dispatch", default="native,avx2", help="comma-separated: native, avx2")
    p.add_argument("--out", default="bench-results/first_start.json")


def _warm_home(home: str, locations: list[str], model: str, threads: int, env: dict) -> float:
    """Measure the model's kernel table into ``home``'s cache (a subprocess: the dispatch level is set before
    torch loads); -> seconds it took (what a first start cost before plans were kept off the request path)."""
    code = (
        "import sys, time, torch; torch.set_num_threads(int(sys.argv[3]))\n"
        "from compute.kernels import int8; from compute.modeling.config import ModelConfig\n"
        "from compute.modeling.model import linear_shapes\n"
        "from paramstore import ParamStore, StoreConfig\n"
        "with ParamStore(StoreConfig(sys.argv[1].split(','))) as s: cfg = ModelConfig.from_hf(s.manifest(sys.argv[2]).config)\n"
        "t = time.perf_counter(); int8.plan_for(linear_shapes(cfg), int(sys.argv[3])); print(time.perf_counter() - t)\n"
    )  # fmt: skip
    env = {**env, "HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache")}
    out = subprocess.run([sys.executable, "-c", code, ",".join(locations), model, str(threads)], env=env,
                         capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def _round(locations: list[str], model: str, home: str, threads: int, env: dict, log_dir: str) -> dict:
    from compute.node.launcher import Services

    env = {**env, "HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache")}
    svc = Services(locations, model, log_dir, env=env)
    t0 = time.monotonic()
    up = svc.start("up", ["up", "--log-dir", log_dir, "--threads-per-node", str(threads)])
    try:
        chat = subprocess.run([sys.executable, "-m", "autoscaler.cli", "chat", QUESTION, "--url", up.url, "--model",
                               model, "--max-tokens", "12", "--wait", "300"], capture_output=True, text=True,
                              timeout=360, env={**svc.env, **env})  # fmt: skip
        seconds = time.monotonic() - t0
    finally:
        svc.stop_all()
    return {"seconds": round(seconds, 2), "ok": chat.returncode == 0 and "Paris" in chat.stdout,
            "answer": chat.stdout.strip()[:80], "retried_503": "retrying" in chat.stderr,
            "stderr": chat.stderr.strip()[-300:]}  # fmt: skip


def main(args) -> int:
    from benchmarks.common import cpu_flags, ensure_model, loadavg
    from paramstore import ParamStore, StoreConfig

    tmp = tempfile.mkdtemp(prefix="pdserve-bench-first-")
    cfg = StoreConfig(args.store) if args.store else StoreConfig.local_default(os.path.join(tmp, "store"))
    locations = ensure_model(cfg, args.model)
    levels = [d.strip() for d in args.dispatch.split(",") if d.strip()]
    if any(d not in DISPATCH for d in levels):
        raise ValueError(f"--dispatch takes {', '.join(DISPATCH)}")
    report = {"cpu_flags": cpu_flags(), "model": args.model, "threads_per_node": args.threads_per_node,
              "rounds": args.rounds, "levels": {}}  # fmt: skip
    for level in levels:
        env = {**os.environ, **DISPATCH[level]}
        warm = os.path.join(tmp, f"warm-home-{level}")
        os.makedirs(warm)
        measure_s = _warm_home(warm, locations, args.model, args.threads_per_node, env)
        print(f"[{level}] a kernel measurement of {args.model} takes {measure_s:.1f} s here (what a first start "
              f"waited for before)", file=sys.stderr, flush=True)  # fmt: skip
        rows = {"first": [], "warm": []}
        for r in range(args.rounds):
            for kind in ("first", "warm"):
                if kind == "first":
                    with ParamStore(StoreConfig(locations)) as store:  # this machine class has no plan yet
                        for row in store.plans.list():
                            store.plans.delete(row["id"])
                    home = tempfile.mkdtemp(dir=tmp, prefix=f"first-home-{level}-")
                else:
                    home = warm
                out = _round(locations, args.model, home, args.threads_per_node, env, tempfile.mkdtemp(dir=tmp))
                out["loadavg"] = loadavg()
                rows[kind].append(out)
                print(f"[{level}] round {r + 1} {kind}: {out['seconds']:.1f} s launch -> answer"
                      f"{'' if out['ok'] else ' FAILED: ' + out['stderr']}", file=sys.stderr, flush=True)  # fmt: skip
        med = {k: statistics.median(x["seconds"] for x in v) for k, v in rows.items()}
        report["levels"][level] = {"measure_s": round(measure_s, 1), "median_s": med,
                                   "first_over_warm": round(med["first"] / med["warm"], 2),
                                   "all_ok": all(x["ok"] for v in rows.values() for x in v), "runs": rows}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nlaunch -> answer, `pdserve up` then `pdserve chat` at once ({args.model}, {args.threads_per_node} "
          f"thread(s) per node, median of {args.rounds}; CPU flags: {' '.join(report['cpu_flags'])})")  # fmt: skip
    print(f"{'dispatch':10} {'first start':>12} {'warm start':>11} {'first/warm':>11} {'a measurement':>14}  all answered")
    for level, r in report["levels"].items():
        print(f"{level:10} {r['median_s']['first']:>10.1f} s {r['median_s']['warm']:>9.1f} s "
              f"{r['first_over_warm']:>10.2f}x {r['measure_s']:>12.1f} s  {r['all_ok']}")  # fmt: skip
    print(f"(written to {args.out})")
    return 0 if all(r["all_ok"] for r in report["levels"].values()) else 1
