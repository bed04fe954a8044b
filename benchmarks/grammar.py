"""`pdserve bench grammar`: what structured output costs per decode step, on the real model, in process.

    pdserve bench grammar [--store URL ...] [--model smollm2] [--repeat 3] [--tokens 32] [--threads 2]
                          [--out bench-results/grammar.json]

For 1 and 32 streams, interleaved (each repeat runs every case in turn), medians reported:

- ms per decode step (steps where every stream decodes, prefill excluded) of free text (the baseline)
  and of the same streams each under a grammar: ``json_schema`` (response_format), ``regex`` (the
  extension) and ``tool call`` (gateway/api/tools.py's grammar for tool_choice required); each grammar is
  sized so that no stream reaches its end within ``--tokens``: every step masks every row;
- the mask alone: ``compute.engine.grammar.mask_logits`` (the sampler's own call: llguidance's bitmask of
  every row, unpacked and applied), timed inside those steps, in us per step.

Ratios: grammar step / free step, and the mask's share of a free step (steadier on a shared box than
the step ratio). If the store lacks ``--model`` it is imported first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

STREAMS = (1, 32)
LONG = 1000  # characters a grammar needs before it may end: more than --tokens tokens can write


def grammars_to_run() -> dict[str, dict]:
    from gateway.api.tools import Tool, calls_grammar

    query = {"type": "object", "properties": {"query": {"type": "string", "minLength": LONG}}, "required": ["query"],
             "additionalProperties": False}  # fmt: skip
    tool = Tool.model_validate({"type": "function", "function": {"name": "search", "parameters": query}})
    answer = {"type": "object", "properties": {"answer": {"type": "string", "minLength": LONG}}, "required": ["answer"]}
    return {
        "json_schema": {"type": "json_schema", "schema": answer},
        "regex": {"type": "regex", "pattern": f"[A-Za-z ,.]{{{LONG}}}"},
        "tool call": calls_grammar([tool], several=False),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="int8 model in the store (imported from the GGUF if absent)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats (medians reported)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per stream")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench-results/grammar.json")


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.common import ensure_model
    from benchmarks.engine import QUESTIONS, cpu_line
    from compute.engine.grammar import Grammars
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore
    from paramstore.config import store_config

    torch.set_num_threads(args.threads)
    cfg = store_config(args)
    ensure_model(cfg, args.model)
    with ParamStore(cfg) as store:
        with store.reader(args.model) as r:
            tokenizer_json = r.bundle()["tokenizer.json"]
        inj = WeightInjector(store, args.model).start()
        inj.wait()
    model, bundle = inj.model, inj.bundle
    grammars = Grammars(tokenizer_json, model.config.vocab_size, bundle.eos_token_ids)
    specs = grammars_to_run()
    chats = [bundle.encode(bundle.render_chat([{"role": "user", "content": q}])) for q in QUESTIONS]
    samples: dict[str, list[float]] = {}
    for r in range(args.repeat):
        for n in STREAMS:
            prompts = [chats[i % len(chats)] for i in range(n)]
            cases = list({"free": None, **specs}.items())
            for name, spec in cases[r % len(cases):] + cases[: r % len(cases)]:  # each repeat starts elsewhere
                step_ms, mask_us = _run(model, grammars, prompts, spec, args.tokens)
                samples.setdefault(f"{name}/{n}", []).append(step_ms)
                if mask_us is not None:
                    samples.setdefault(f"mask {name}/{n}", []).append(mask_us)
        print(f"repeat {r + 1}/{args.repeat}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in samples.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in samples.items()}
    _print_table(med, list(specs), cpu_line())
    report = {"model": args.model, "threads": args.threads, "repeat": args.repeat, "tokens": args.tokens,
              "median": med, "samples": samples, "cpu": cpu_line(), "grammars": specs}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _run(model, grammars, prompts: list[list[int]], spec: dict | None, tokens: int) -> tuple[float, float | None]:
    """(median ms of the engine's steps in which every stream decodes, each under ``spec`` or free;
    median us of the sampler's mask call for all rows in those steps, timed where it runs)."""
    import compute.engine.grammar as cg
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.engine.sequence import Sequence

    eng = Engine.for_model(model, num_blocks=sum(-(-(len(p) + tokens) // 16) for p in prompts) + 64)
    for p in prompts:
        seq = Sequence(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=spec is None, grammar=spec))
        seq.matcher = grammars.matcher(spec) if spec is not None else None
        eng.scheduler.add(seq)
    steps, masks, calls = [], [], []
    mask_logits = cg.mask_logits

    def timed(x, matchers):  # the sampler imports it at each call: this stands in for the run
        t0 = time.perf_counter()
        mask_logits(x, matchers)
        calls.append((len(matchers), time.perf_counter() - t0))

    cg.mask_logits = timed
    try:
        while eng.has_unfinished():
            calls.clear()
            t0 = time.perf_counter()
            eng.step()
            if eng.last_step == (len(prompts), 0):
                steps.append(time.perf_counter() - t0)
                masks += [t for n, t in calls if n == len(prompts)]
    finally:
        cg.mask_logits = mask_logits
    return 1e3 * statistics.median(steps), (1e6 * statistics.median(masks) if masks else None)


def _print_table(med: dict, names: list[str], cpu: str) -> None:
    print(f"CPU: {cpu}")
    print("| streams | free (ms/step) | " + " | ".join(f"{g} (ms/step)" for g in names) + " | "
          + " | ".join(f"{g} / free" for g in names) + " | " + " | ".join(f"mask {g} (us)" for g in names)
          + " | " + " | ".join(f"mask {g} / free step" for g in names) + " |")  # fmt: skip
    print("|" + "---|" * (2 + 4 * len(names)))
    for n in STREAMS:
        free = med[f"free/{n}"]
        cells = [f"{med[f'{g}/{n}']:.1f}" for g in names] + [f"{med[f'{g}/{n}'] / free:.2f}x" for g in names]
        cells += [f"{med[f'mask {g}/{n}']:.0f}" for g in names]
        cells += [f"{med[f'mask {g}/{n}'] / 1e3 / free:.1%}" for g in names]
        print(f"| {n} | {free:.1f} | " + " | ".join(cells) + " |")
