"""`pdserve bench weight-copies`: batched matmuls with int8 weights and no resident bf16 copy, vs the bf16 copy.

    pdserve bench weight-copies [--m 8 32 128 512] [--rounds 15] [--threads 2] [--out bench-results/weight_copies.json]
    pdserve bench weight-copies --steps [--weight-copies-gb 0]   # decode steps of the real model, default vs budget

Per SmolLM2 shape (``SHAPES``: as the model runs them, fused qkv and gate/up included) and M, each candidate is
timed once per round, all candidates in turn within a round (a noisy neighbour hits each alike); medians of the
rounds (and the min, and the median of the process's CPU time per call, which a loaded box inflates far less than
wall time: the box is shared), and each candidate's ratio to the ``bf16 copy`` (the measured plan's batched kernel today: a resident bf16
weight, ``F.linear``). Inputs are fp32 activations as the int8 runtime passes them (``compute.kernels.linear``),
outputs any float dtype. Error: relative RMS vs an fp64 reference on activations with outlier channels
(``compute.kernels.int8._outlier_input``), at M = 16.

Candidates (the brief's (a), (b), (c)); bytes held per weight beside the int8 one in brackets:

- ``bf16 copy`` [+2 B/param]: ``F.linear(x.bf16(), w_bf16)``, w_bf16 = (q * scale).bf16() resident;
- ``int8mm`` [0]: ``aten._weight_int8pack_mm`` (weight-only int8; its cost is linear in M on x86);
- ``dequant`` [0]: q * scale into a reused fp32 scratch, fp32 ``F.linear``;
- ``otf`` [0, a scratch]: (a) q -> bf16 per call into a reused scratch (exact: |q| <= 127), bf16 ``F.linear``,
  scale after;
- ``otf tiled`` [0, 1 MiB scratch]: (a) the same in N-tiles of ``TILE_BYTES`` of bf16 (within L2), each its own GEMM;
- ``w8a8`` [0]: (b) x quantized per row to int8, ``torch._int_mm`` (s8s8s32, VNNI); error ~4%: out by the gate;
- ``w8a16`` [0]: (b') x split per row into two int8 levels (x ~ a (hi + lo / 254)), one ``torch._int_mm`` over the
  2M stacked rows: integer-exact, so batch-invariant by construction, and ~20x closer to fp32 than bf16;
- ``w8a16 packed`` [+1 B/param: oneDNN's blocked int8 copy, made once]: the same two levels (as u8 with zero point
  128) on ``torch.ops.onednn.qlinear_pointwise`` over a weight packed once by ``onednn.qlinear_prepack``: no reorder of
  the weight per call. Runtime weights stay ~1x only if the packed weight *replaces* the plain one (M = 1 included);
- ``qlinear dyn`` [+1 B/param: a packed int8 copy]: (c) ``torch.ops.quantized.linear_dynamic`` (x86 engine:
  per-tensor dynamic activation int8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SHAPES = ((576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576))
M_DEFAULT = (8, 32, 128, 512)
TILE_BYTES = 1 << 20  # otf tiled: bf16 bytes of one N-tile (L2 is 1 MiB per core on the Zen 4 box)
ROUND_BUDGET_S = 20.0  # per (shape, M): fewer rounds once this is spent (the head at M = 512 takes ~0.2 s a call)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int, nargs="+", default=list(M_DEFAULT), help="rows of the activation")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (medians reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", nargs="+", default=None, help="NxK shapes (default: SmolLM2's)")
    p.add_argument("--steps", action="store_true", help="instead: decode steps of the real model, the default plan vs "
                   "--weight-copies-gb, alternating step by step (1 and 32 streams; the model imported if missing)")
    p.add_argument("--weight-copies-gb", type=float, default=0.0, help="the budget --steps compares (default 0)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="bench-results/weight_copies.json")


def candidates():
    """name -> (make(q, scale) -> state, call(x, state) -> y, bytes held beside the int8 weight per param)."""
    import torch
    import torch.nn.functional as F

    from compute.kernels import int8

    def bf16_copy(q, s):
        return int8.bf16_weight(q, s)

    scratch = {}

    def otf_make(q, s):
        n = q.numel()
        if scratch.get("otf") is None or scratch["otf"].numel() < n:
            scratch["otf"] = torch.empty(n, dtype=torch.bfloat16)
        return q, s.to(torch.bfloat16)

    def otf(x, st):
        q, sb = st
        w = scratch["otf"][: q.numel()].view(q.shape)
        w.copy_(q)
        return F.linear(x.to(torch.bfloat16), w).mul_(sb)

    def otf_tiled(x, st):
        q, sb = st
        n, k = q.shape
        rows = max(16, min(n, (TILE_BYTES // 2) // k))
        xb = x.to(torch.bfloat16)
        if rows >= n:
            w = scratch["otf"][: q.numel()].view(q.shape)
            w.copy_(q)
            return F.linear(xb, w).mul_(sb)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        buf = scratch["otf"]
        for i in range(0, n, rows):
            j = min(n, i + rows)
            w = buf[: (j - i) * k].view(j - i, k)
            w.copy_(q[i:j])
            y[:, i:j] = F.linear(xb, w)
        return y.mul_(sb)

    def w8a16p_make(q, s):
        n = q.shape[0]
        return torch.ops.onednn.qlinear_prepack(q, None), s, torch.ones(n), torch.zeros(n, dtype=torch.long)

    def w8a16p(x, st):
        packed, s, ones, zps = st
        m = x.shape[0]
        x32 = x.to(torch.float32)
        a = torch.linalg.vector_norm(x32, float("inf"), 1, keepdim=True).clamp_min_(1e-30).div_(127.0)
        t = x32 / a
        levels = torch.empty(2 * m, x32.shape[1])
        hi = torch.round(t, out=levels[:m])
        torch.sub(t, hi, out=levels[m:]).mul_(int8.W8A16_LO).round_()
        u8 = levels.add_(128.0).to(torch.uint8)
        acc = torch.ops.onednn.qlinear_pointwise(u8, 1.0, 128, packed, ones, zps, None, 1.0, 0, torch.float32,
                                                 "none", [], "")  # fmt: skip
        return acc[m:].div_(int8.W8A16_LO).add_(acc[:m]).mul_(a).mul_(s)

    def qdyn_make(q, s):
        wq = torch.quantize_per_channel(q.float() * s[:, None], s.double(), torch.zeros_like(s, dtype=torch.long),
                                        0, torch.qint8)  # fmt: skip
        return torch.ops.quantized.linear_prepack(wq, None)

    def qdyn(x, packed):
        return torch.ops.quantized.linear_dynamic(x.to(torch.float32), packed, True)

    return {
        "bf16 copy": (bf16_copy, lambda x, w: F.linear(x.to(torch.bfloat16), w), 2),
        "int8mm": (lambda q, s: (q, s.to(torch.bfloat16)),
                   lambda x, st: torch.ops.aten._weight_int8pack_mm(int8.aligned(x.to(torch.bfloat16)), *st), 0),
        "dequant": (lambda q, s: (q, s), lambda x, st: int8.run("dequant", x, st[0], st[1], None, None), 0),
        "otf": (otf_make, otf, 0),
        "otf tiled": (otf_make, otf_tiled, 0),
        "w8a8": (lambda q, s: (q, s), lambda x, st: int8.run("w8a8", x, st[0], st[1], None, None), 0),
        "w8a16": (lambda q, s: (q, s), lambda x, st: int8.w8a16(x, st[0], st[1]), 0),
        "w8a16 packed": (w8a16p_make, w8a16p, 1),
        "qlinear dyn": (qdyn_make, qdyn, 1),
    }


def measure(shapes, ms, rounds: int, log=print) -> dict:
    import torch

    from compute.kernels import int8

    gen = torch.Generator().manual_seed(0)
    cands = candidates()
    out: dict = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        s = w.abs().amax(1).clamp_min(1e-8) / 127.0
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        state = {c: make(q, s) for c, (make, _, _) in cands.items()}
        xe = int8._outlier_input(16, k, gen)
        ref = xe.double() @ (q.double() * s.double()[:, None]).t()
        err = {c: float((call(xe, state[c]).double() - ref).norm() / ref.norm()) for c, (_, call, _) in cands.items()}
        entry = {"error": {c: round(e, 5) for c, e in err.items()}, "held_bytes_per_param": {c: b for c, (_, _, b) in cands.items()},
                 "us": {}, "us_min": {}, "ratio_to_bf16_copy": {}, "ratio_min_to_bf16_copy": {},
                 "cpu_us": {}, "cpu_ratio_to_bf16_copy": {}}  # fmt: skip
        for m in ms:
            x = torch.randn(m, k, generator=gen)
            times: dict[str, list[float]] = {c: [] for c in cands}
            cpu: dict[str, list[float]] = {c: [] for c in cands}  # process CPU seconds: robust to a loaded box
            for c, (_, call, _) in cands.items():
                call(x, state[c])  # warm
            t_end = time.perf_counter() + ROUND_BUDGET_S
            for r in range(rounds):
                if r >= 3 and time.perf_counter() > t_end:
                    break
                for c, (_, call, _) in cands.items():
                    c0, t0 = time.process_time(), time.perf_counter()
                    call(x, state[c])
                    times[c].append(time.perf_counter() - t0)
                    cpu[c].append(time.process_time() - c0)
            med = {c: statistics.median(v) * 1e6 for c, v in times.items()}
            low = {c: min(v) * 1e6 for c, v in times.items()}
            work = {c: statistics.median(v) * 1e6 for c, v in cpu.items()}
            entry["cpu_us"][str(m)] = {c: round(v, 1) for c, v in work.items()}
            entry["cpu_ratio_to_bf16_copy"][str(m)] = {c: round(v / max(work["bf16 copy"], 1e-3), 2) for c, v in work.items()}
            entry["us"][str(m)] = {c: round(v, 1) for c, v in med.items()}
            entry["us_min"][str(m)] = {c: round(v, 1) for c, v in low.items()}
            entry["ratio_to_bf16_copy"][str(m)] = {c: round(v / med["bf16 copy"], 2) for c, v in med.items()}
            entry["ratio_min_to_bf16_copy"][str(m)] = {c: round(v / low["bf16 copy"], 2) for c, v in low.items()}
            log(f"{n}x{k} M={m:<4} rounds {len(times['bf16 copy'])}, wall median (min) us, x the bf16 copy [CPU time x]: "
                + "  ".join(f"{c} {med[c]:.0f} ({low[c]:.0f}) {med[c] / med['bf16 copy']:.2f}x ({low[c] / low['bf16 copy']:.2f}x)"
                            f" [{entry['cpu_ratio_to_bf16_copy'][str(m)][c]:.2f}x]" for c in cands), flush=True)  # fmt: skip
        log(f"{n}x{k} error vs fp64 (outlier activations): " + ", ".join(f"{c} {e:.2%}" for c, e in err.items()),
            flush=True)  # fmt: skip
        out[f"{n}x{k}"] = entry
    return out


def steps(args, log=print) -> dict:
    """One decode step of the real model under the default plan and one under ``--weight-copies-gb``, alternating
    (ABAB, each engine warm in steady decode): a loaded box hits both alike. -> {streams: {name: [seconds]}}."""
    from benchmarks.common import bundle, ensure_model
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore
    from paramstore.config import store_config

    cfg = store_config(argparse.Namespace(store=None, config=None, hmac_key_file=None))
    locations = ensure_model(cfg, args.model)
    b = bundle(locations, args.model)
    chats = [b.encode(b.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
    out: dict = {}
    with ParamStore(cfg) as store:
        models = {name: WeightInjector(store, args.model, weights="int8", measure="blocking", weight_copies_gb=gb).start()
                  for name, gb in (("default", -1), (f"copies<={args.weight_copies_gb:g}GiB", args.weight_copies_gb))}
        for inj in models.values():
            inj.wait()
        for streams in (1, 32):
            engines = {}
            for name, inj in models.items():
                eng = Engine.for_model(inj.model, num_blocks=streams * 12 + 64)
                for i in range(streams):
                    eng.add_request(chats[i % len(chats)], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                for _ in range(12):  # past every prefill
                    eng.step()
                engines[name] = eng
            t = out[streams] = {n: [] for n in engines}
            t_end = time.perf_counter() + 90
            for r in range(60):
                if r >= 10 and time.perf_counter() > t_end:
                    break
                for n, eng in engines.items():
                    t0 = time.perf_counter()
                    eng.step()
                    t[n].append(time.perf_counter() - t0)
            (a, va), (c, vc) = t.items()
            log(f"{streams} streams, {len(va)} steps each: {a} min {min(va) * 1e3:.1f} ms median "
                f"{statistics.median(va) * 1e3:.1f} ms; {c} min {min(vc) * 1e3:.1f} ms median {statistics.median(vc) * 1e3:.1f}"
                f" ms; {c} / {a}: {min(vc) / min(va):.2f}x (min), {statistics.median(vc) / statistics.median(va):.2f}x "
                "(median)", flush=True)  # fmt: skip
    return out


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does."]  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.common import cpu_flags, loadavg
    from compute.kernels.int8 import machine

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else list(SHAPES)
    load0 = loadavg()
    print(f"CPU: {machine()}; flags {' '.join(cpu_flags())}; {args.threads} threads; torch {torch.__version__}; "
          f"load {load0}", flush=True)  # fmt: skip
    if args.steps:
        res = steps(args)
    else:
        with torch.inference_mode():
            res = measure(shapes, args.m, args.rounds)
    doc = {"machine": machine(), "cpu_flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
           "rounds": args.rounds, "load_before": load0, "load_after": loadavg(), "steps" if args.steps else "shapes": res}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"load average {load0} -> {doc['load_after']}; written to {args.out}")
    return 0


if __name__ == "__main__":  # python -m benchmarks.weight_copies (also: pdserve bench weight-copies)
    _p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_p)
    raise SystemExit(main(_p.parse_args()))
