"""`pdserve bench kernels`: the int8 linears against this machine's memory bandwidth, native vs ATen's kernels.

    pdserve bench kernels [--m 1 2 4 8 16 32] [--rounds 15] [--threads 2] [--out bench-results/kernels.json]
    ATEN_CPU_CAPABILITY=avx2 pdserve bench kernels      # the AVX2 bodies (ours and ATen's) on an AVX-512 CPU

At M = 1 a linear reads each weight byte once: its floor is bytes / bandwidth. The bandwidth is measured in the
same run (``read_gbs``: a 2-thread max-reduction over 256 MiB of int8, best of 5: what streaming a model's weights
can reach), and each kernel's time is given as GB/s of weights and as a share of it. Shapes are SmolLM2's as the
model runs them (fused q/k/v and gate/up, the tied 49152 x 576 head) plus the whole model's linears at one step
(``model``: every shape times its count, one call each, summed). Each round times every kernel once, in turn
(interleaved: a noisy neighbour hits each alike); medians of the rounds, min beside. ``native`` is
``compute.kernels.native``; ``int8mm`` ATen's ``_weight_int8pack_mm`` on bf16 input (the kernel before it);
``dequant`` the fp32 GEMM on a dequantized scratch; the bf16 / int8-GEMM kernels where this CPU has them
(``int8.candidates``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# SmolLM2-135M's int8 linears as the model runs them: (N, K) -> calls per decode step
SHAPES = {(960, 576): 30, (576, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="rows of activations")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench-results/kernels.json")


def read_gbs(threads: int) -> float:
    """GB/s of a streaming read of 256 MiB (int8 max-reduction, ``threads`` threads, best of 5)."""
    import torch

    buf = torch.ones(256 * 2**20, dtype=torch.int8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.max()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() / best / 1e9


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.common import cpu_flags, cpu_model, loadavg
    from compute.kernels import int8, native

    torch.set_num_threads(args.threads)
    if not native.available():
        print(f"pdserve bench kernels: native kernels unavailable ({native.why_unavailable()})")
        return 2
    kernels = [k for k in int8.candidates() if k in ("native", "int8mm", "dequant", "bf16", "w8a16")]
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        scale = w.abs().amax(1) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        wb = int8.bf16_weight(q, scale) if "bf16" in kernels else None
        weights[(n, k)] = (q, scale, scale.to(torch.bfloat16), wb)
    bw = read_gbs(args.threads)
    times: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        xs = {(m, k): torch.randn(m, k, generator=gen) for m in args.m for k in {k for _, k in SHAPES}}
        for r in range(args.rounds + 1):  # round 0 warms up
            for m in args.m:
                for (n, k), (q, s, sb, wb) in weights.items():
                    for c in kernels:
                        if not int8.usable(c, n, k):
                            continue
                        t0 = time.perf_counter()
                        int8.run(c, xs[(m, k)], q, s, sb, wb)
                        if r:
                            times.setdefault((c, n, k, m), []).append(time.perf_counter() - t0)
    rows = []
    for (c, n, k, m), ts in sorted(times.items(), key=lambda kv: (kv[0][3], kv[0][1], kv[0][2], kv[0][0])):
        med = statistics.median(ts)
        rows.append({"kernel": c, "n": n, "k": k, "m": m, "us": round(med * 1e6, 1), "min_us": round(min(ts) * 1e6, 1),
                     "gbs": round(n * k / med / 1e9, 2), "of_bw": round(n * k / med / 1e9 / bw, 3)})  # fmt: skip
    for m in args.m:  # the whole model's linears at one step
        for c in kernels:
            per = [(times.get((c, n, k, m)), cnt, n * k) for (n, k), cnt in SHAPES.items()]
            if any(t is None for t, _, _ in per):
                continue
            us = sum(statistics.median(t) * cnt for t, cnt, _ in per)
            nbytes = sum(cnt * b for _, cnt, b in per)
            rows.append({"kernel": c, "n": "model", "k": "", "m": m, "us": round(us * 1e6, 1), "min_us": None,
                         "gbs": round(nbytes / us / 1e9, 2), "of_bw": round(nbytes / us / 1e9 / bw, 3)})  # fmt: skip
    head = (f"{cpu_model()} | flags: {' '.join(cpu_flags())} | dispatch {torch.backends.cpu.get_cpu_capability()} | "
            f"native body {native.isa()} | {args.threads} threads | load {loadavg()} | read bandwidth {bw:.1f} GB/s")  # fmt: skip
    print(head)
    print("| shape | M | " + " | ".join(f"{c} us (GB/s, % bw)" for c in kernels) + " | native vs int8mm |")
    print("|---|---:|" + "---:|" * (len(kernels) + 1))
    by = {(r["kernel"], r["n"], r["k"], r["m"]): r for r in rows}
    for m in args.m:
        for n, k in [*SHAPES, ("model", "")]:
            cells, ours, theirs = [], by.get(("native", n, k, m)), by.get(("int8mm", n, k, m))
            for c in kernels:
                r = by.get((c, n, k, m))
                cells.append("-" if r is None else f"{r['us']:.0f} ({r['gbs']:.1f}, {r['of_bw'] * 100:.0f}%)")
            ratio = f"{theirs['us'] / ours['us']:.2f}x" if ours and theirs else "-"
            print(f"| {n}{'x' + str(k) if k else ''} | {m} | " + " | ".join(cells) + f" | {ratio} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host": head, "read_gbs": bw, "threads": args.threads, "rounds": args.rounds, "rows": rows}, f,
                  indent=1)  # fmt: skip
    print(f"wrote {args.out}")
    return 0
