"""Does a compiled decode step beat eager? (measure only)

    python -m benchmarks.graph_step [--models smollm2-int4 smollm2] [--streams 1 8]
        [--variants inductor cpp-freeze cpp-freeze-autotune aoti] [--rounds 100] [--out bench-results/graph_step.json]

For each (model, streams, variant), two fresh processes (``--child``), each bounded by ``--timeout``:

1. **cold**: an empty ``TORCHINDUCTOR_CACHE_DIR``; the model loads from the store (``benchmarks.engine.Ours``), a
   prompt per stream is prefilled eagerly into a KV cache and copied to a second one; ``GraphStep``
   (``compute/modeling/graph_step.py``) is compiled (the first call, timed: the cold compile) or, for ``aoti``,
   exported, compiled and packaged (timed) then loaded (timed);
2. the check: ``CHECK_STEPS`` greedy decode steps, the engine's eager forward on one cache and the compiled step on
   the other: tokens equal per stream, the largest logit difference while they agree; the uncompiled
   ``GraphStep`` against the eager forward on the first step (what the rewrite alone changes);
3. the timing: eager (``ForwardBatch.build`` + ``Transformer.forward``), the compiled step (``step_inputs`` + the
   compiled call) and the uncompiled ``GraphStep``, interleaved ABC for ``--rounds`` rounds after a warm-up, each
   the same decode step repeated at a fixed position: medians and mins, ratio eager / compiled;
   ATen ops per step under ``torch.profiler`` (an ``aten::`` event is one dispatch);
4. **warm**: the same in a second process on the same cache directory (``aoti``: the package loaded in a fresh
   process, what a fresh node would pay instead of compiling); its compile (load) seconds, check, a short timing.

Every figure is printed beside the box's load average (before / after) and the CPU's vector flags.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CHECK_STEPS = 32
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does.", "Name a famous painter.", "How many legs does a spider have?",
             "What is photosynthesis?", "Give me a synonym for happy."]  # fmt: skip
# name -> (inductor config, torch.compile mode); "aoti": torch.export + AOTInductor instead of torch.compile
VARIANTS = {
    "none": ({}, None),  # the uncompiled GraphStep (a smoke test of the check and the timing)
    "inductor": ({}, None),
    "freeze": ({"freezing": True}, None),
    "cpp-freeze": ({"cpp_wrapper": True, "freezing": True}, None),
    "cpp-freeze-autotune": ({"cpp_wrapper": True, "freezing": True}, "max-autotune-no-cudagraphs"),
    "aoti": ({}, None),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--models", nargs="+", default=["smollm2-int4", "smollm2"])
    p.add_argument("--streams", nargs="+", type=int, default=[1])
    p.add_argument("--variants", nargs="+", default=["cpp-freeze", "inductor", "aoti"], choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=100, help="timed steps per side (interleaved)")
    p.add_argument("--warm-rounds", type=int, default=30, help="timed steps per side in the warm process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-blocks", type=int, default=512,
                   help="KV cache blocks (a real-sized cache: a graph that copied it per step would show)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    p.add_argument("--no-warm", action="store_true", help="skip the second (warm-cache / package-load) process")
    p.add_argument("--out", default="bench-results/graph_step.json")
    # child mode (one variant in this process)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--package", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return 0
    from benchmarks.common import cpu_flags, ensure_model
    from paramstore.config import store_config

    cfg = store_config(args)
    for m in args.models:
        ensure_model(cfg, m, "int4" if m.endswith("-int4") else "int8")
    rows = []
    with tempfile.TemporaryDirectory(prefix="graph_step_") as tmp:
        for model in args.models:
            for n in args.streams:
                for variant in args.variants:
                    cache = os.path.join(tmp, f"{model}-{n}-{variant}")
                    pkg = os.path.join(tmp, f"{model}-{n}.pt2")
                    for phase in ("cold",) if args.no_warm else ("cold", "warm"):
                        r = _spawn(args, model, n, variant, phase, cache, pkg)
                        rows.append(r)
                        print(_line(r), flush=True)
                        if "error" in r:
                            break
    report = {"cpu_flags": cpu_flags(), "threads": args.threads, "rows": rows}
    _print_table(rows, report["cpu_flags"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _spawn(args, model: str, n: int, variant: str, phase: str, cache: str, pkg: str) -> dict:
    """One child process (``--child``), bounded by ``args.timeout``; its JSON line, or what went wrong."""
    cmd = [sys.executable, "-m", "benchmarks.graph_step", "--child", "--model", model, "--n", str(n),
           "--variant", variant, "--phase", phase, "--package", pkg, "--threads", str(args.threads),
           "--rounds", str(args.rounds if phase == "cold" else args.warm_rounds),
           "--cache-blocks", str(args.cache_blocks)]  # fmt: skip
    for s in args.store or ():
        cmd += ["--store", s]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    base = {"model": model, "streams": n, "variant": variant, "phase": phase, "load_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    # a session of its own: on a timeout its whole group goes (inductor's compile workers with it)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return base | {"error": f"timed out after {args.timeout:.0f} s"}
    finally:
        if p.poll() is None:  # interrupted: stop what it started
            os.killpg(p.pid, signal.SIGKILL)
    base["wall_s"] = time.perf_counter() - t0
    lines = stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-3:]
        return base | {"error": f"rc {p.returncode}: " + " | ".join(tail)}
    return base | json.loads(lines[-1])


# -- child ------------------------------------------------------------------------------------


def _child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.engine import Ours
    from compute.modeling.batch import ForwardBatch
    from compute.modeling.graph_step import GraphStep, bucket_len, decode, graph_args, step_inputs
    from compute.modeling.kv_cache import KVCache
    from paramstore import ParamStore
    from paramstore.config import store_config

    out: dict = {"load_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    ours = Ours(ParamStore(store_config(args)), args.model, "int8")
    out["model_load_s"] = time.perf_counter() - t0
    model, bundle, n = ours.model, ours.bundle, args.n
    prompts = [bundle.encode(bundle.render_chat([{"role": "user", "content": QUESTIONS[i % 8] + " " +
                                                 " ".join(QUESTIONS)}])) for i in range(n)]  # fmt: skip
    keys = bucket_len(max(map(len, prompts)) + CHECK_STEPS + 1)
    bs, per = 16, -(-keys // 16)
    tables = [list(range(1 + j * per, 1 + (j + 1) * per)) for j in range(n)]  # block 0 stays the padding slot
    blocks = max(n * per + 1, args.cache_blocks)
    caches = [KVCache(model.config, blocks, bs, torch.bfloat16) for _ in range(2)]  # eager, graph
    with torch.inference_mode():
        first = model(ForwardBatch.build(prompts, [0] * n, tables, bs), caches[0]).argmax(-1).tolist()
        caches[1].kv.copy_(caches[0].kv)
        step = GraphStep(model, n).eval()
        pos = [len(p) for p in prompts]
        fn, out_c = _compile(step, args, graph_args(step_inputs(first, pos, tables, bs, keys), caches[1].kv.clone()))
        out |= out_c
        pure = decode(step, step, step_inputs(first, pos, tables, bs, keys), caches[1].kv.clone())
        eager0 = model(ForwardBatch.build([[t] for t in first], pos, tables, bs), _cloned(caches[0], model.config))
        out["pure_vs_eager_max_abs"] = (pure - eager0).abs().max().item()
        t0 = time.perf_counter()
        out |= _check(model, fn, step, first, pos, tables, bs, keys, caches, ForwardBatch, step_inputs, decode)
        out["check_s"] = time.perf_counter() - t0
        out |= _timing(model, fn, step, out.pop("_state"), tables, bs, keys, caches, args.rounds, ForwardBatch,
                       step_inputs, decode)  # fmt: skip
    out["load_end"] = os.getloadavg()[0]
    out["kinds"] = sorted(set(step.kinds.values()))
    return out


def _cloned(cache, config):
    """A second KVCache with ``cache``'s contents (a step on it leaves ``cache`` as it was)."""
    from compute.modeling.kv_cache import KVCache

    c = KVCache(config, cache.num_blocks, cache.block_size, cache.dtype)
    c.kv.copy_(cache.kv)
    return c


def _compile(step, args, inputs: tuple) -> tuple:
    """(the compiled callable, {compile_s | export_s, package_s, load_s, graphs}): its first call on ``inputs``
    (``GraphStep.forward``'s arguments) is the compile."""
    import torch

    if args.variant == "aoti":
        return _aoti(step, args, inputs)
    if args.variant == "none":
        return step, {"compile_s": 0.0}
    cfg, mode = VARIANTS[args.variant]
    for k, v in cfg.items():
        setattr(torch._inductor.config, k, v)
    from torch._dynamo.utils import counters

    fn = torch.compile(step, dynamic=False, fullgraph=True, mode=mode)
    t0 = time.perf_counter()
    fn(*inputs)
    t = time.perf_counter() - t0
    return fn, {"compile_s": t, "graphs": counters["stats"]["unique_graphs"]}


def _aoti(step, args, inputs: tuple) -> tuple:
    """torch.export + AOTInductor: cold = export + compile + package, then load; warm = load the package only."""
    import torch

    out = {}
    if args.phase == "cold":
        t0 = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(step, inputs)
        out["export_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch._inductor.aoti_compile_and_package(ep, package_path=args.package)
        out["package_s"] = time.perf_counter() - t0
        out["compile_s"] = out["export_s"] + out["package_s"]
        out["package_mb"] = os.path.getsize(args.package) / 2**20
    t0 = time.perf_counter()
    fn = torch._inductor.aoti_load_package(args.package)
    fn(*inputs)
    out["load_s"] = time.perf_counter() - t0
    return fn, out


def _check(model, fn, step, first, pos, tables, bs, keys, caches, ForwardBatch, step_inputs, decode) -> dict:
    """``CHECK_STEPS`` steps, eager on caches[0], compiled on caches[1], both fed the eager greedy tokens (teacher
    forcing): where every step's argmax agrees, free-running greedy output is equal too; else the first step (and
    stream) where they part, and the logit differences per step."""
    tok, p, agree, diffs, first_off = list(first), list(pos), 0, [], None
    for i in range(CHECK_STEPS):
        la = model(ForwardBatch.build([[t] for t in tok], p, tables, bs), caches[0])
        lb = decode(fn, step, step_inputs(tok, p, tables, bs, keys), caches[1].kv)
        diffs.append((la - lb).abs().max().item())
        same = la.argmax(-1).eq(lb.argmax(-1))
        agree += int(same.sum())
        if first_off is None and not same.all():
            j = int((~same).nonzero()[0, 0])
            top = la[j].topk(2).values
            first_off = {"step": i, "stream": j, "eager_top2_gap": (top[0] - top[1]).item()}
        tok, p = la.argmax(-1).tolist(), [x + 1 for x in p]
    return {"greedy_equal": first_off is None, "top1_agree": f"{agree}/{CHECK_STEPS * len(tok)}",
            "first_divergence": first_off, "max_logit_diff": max(diffs), "median_logit_diff": statistics.median(diffs),
            "_state": (tok, tok, p)}  # fmt: skip


def _timing(model, fn, step, state, tables, bs, keys, caches, rounds: int, ForwardBatch, step_inputs,
            decode) -> dict:  # fmt: skip
    """Eager, compiled and uncompiled pure step, interleaved (ABC), the same step repeated at a fixed position."""
    from torch.profiler import ProfilerActivity, profile

    a, b, p = state
    p = [x - 1 for x in p]  # the last checked position: re-running it rewrites the same slots
    runs = {
        "eager": lambda: model(ForwardBatch.build([[t] for t in a], p, tables, bs), caches[0]),
        "graph": lambda: decode(fn, step, step_inputs(b, p, tables, bs, keys), caches[1].kv),
        "pure": lambda: decode(step, step, step_inputs(b, p, tables, bs, keys), caches[1].kv),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(10 + rounds):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            if i >= 10:
                times[k].append((time.perf_counter() - t0) * 1e3)
    out = {f"{k}_ms": {"median": statistics.median(v), "min": min(v)} for k, v in times.items()}
    out["ratio_eager_over_graph"] = out["eager_ms"]["median"] / out["graph_ms"]["median"]
    out["ratio_eager_over_pure"] = out["eager_ms"]["median"] / out["pure_ms"]["median"]
    for k in ("eager", "graph"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runs[k]()
        ev = prof.key_averages()
        out[f"{k}_aten_calls"] = sum(e.count for e in ev if e.key.startswith("aten::"))
        out[f"{k}_events"] = sum(e.count for e in ev)
    return out


# -- report -----------------------------------------------------------------------------------


def _line(r: dict) -> str:
    head = f"{r['model']} x{r['streams']} {r['variant']} ({r['phase']}, load {r['load_before']:.2f})"
    if "error" in r:
        return f"{head}: ERROR {r['error']}"
    t = (f"eager {r['eager_ms']['median']:.2f} / graph {r['graph_ms']['median']:.2f} / pure "
         f"{r['pure_ms']['median']:.2f} ms = {r['ratio_eager_over_graph']:.2f}x") if "eager_ms" in r else ""  # fmt: skip
    c = f"compile {r.get('compile_s', 0):.1f} s" + (f", load {r['load_s']:.2f} s" if "load_s" in r else "")
    return (f"{head}: {t}; {c}; greedy equal {r['greedy_equal']} (top-1 {r['top1_agree']}, first off "
            f"{r['first_divergence']}, logit diff max {r['max_logit_diff']:.2g} median {r['median_logit_diff']:.2g})")


def _print_table(rows: list[dict], flags: list[str]) -> None:
    print(f"CPU flags: {' '.join(flags)}")
    print("| model | streams | variant | phase | eager ms (med/min) | compiled ms (med/min) | eager/compiled | "
          "pure eager ms | compile s | load s | greedy equal | aten calls eager/compiled | load avg |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['streams']} | {r['variant']} | {r['phase']} | error: {r['error'][:120]} |")
            continue
        e, g, pu = r["eager_ms"], r["graph_ms"], r["pure_ms"]
        print(f"| {r['model']} | {r['streams']} | {r['variant']} | {r['phase']} | {e['median']:.2f}/{e['min']:.2f} | "
              f"{g['median']:.2f}/{g['min']:.2f} | {r['ratio_eager_over_graph']:.2f}x | {pu['median']:.2f} | "
              f"{r.get('compile_s', float('nan')):.1f} | {r.get('load_s', float('nan')):.2f} | "
              f"{r['greedy_equal']} ({r['top1_agree']}) | {r['eager_aten_calls']}/{r['graph_aten_calls']} | "
              f"{r['load_start']:.2f}-{r['load_end']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_step", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
