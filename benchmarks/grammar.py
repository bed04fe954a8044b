"""`pdserve bench grammar`: what structured output costs per decode step, on the real model, in process.

    pdserve bench grammar [--store URL ...] [--model smollm2] [--repeat 3] [--tokens 32] [--threads 2]
                          [--out bench-results/grammar.json]

For 1 and 32 streams, interleaved (each repeat runs every case in turn), medians reported:

- ms per decode step (steps where every stream decodes, prefill excluded) of free text (the baseline)
  and of the same streams each under a grammar: ``json_schema`` (response_format), ``regex`` (the
  extension) and ``tool call`` (gateway/tools.py's grammar for tool_choice required); each grammar is
  sized so that no stream reaches its end within ``--tokens``: every step masks every row;
- the mask alone: llguidance's bitmask fill and apply for that many matchers (``compute.grammar.mask_logits``,
  the sampler's own call), in us per step.

Ratio: grammar step / free step. If the store lacks ``--model`` it is imported first.
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
    from gateway.tools import Tool, calls_grammar

    query = {"type": "object", "properties": {"query": {"type": "string", "minLength": LONG}}, "required": ["query"],
             "additionalProperties": False}  # fmt: skip
    tool = Tool.model_validate({"type": "function", "function": {"name": "search", "parameters": query}})
    return {
        "json_schema": {"type": "json_schema", "schema": {"type": "object", "properties": {
            "answer": {"type": "string", "minLength": LONG}}, "required": ["answer"]}},  # fmt: skip
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
    from compute.grammar import Grammars
    from compute.loader import WeightInjector
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
            for name, spec in {"free": None, **specs}.items():
                samples.setdefault(f"{name}/{n}", []).append(_step_ms(model, grammars, prompts, spec, args.tokens))
                if spec is not None:
                    samples.setdefault(f"mask {name}/{n}", []).append(_mask_us(grammars, bundle, spec, n))
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


def _step_ms(model, grammars, prompts: list[list[int]], spec: dict | None, tokens: int) -> float:
    """Median ms of the engine's steps in which every stream decodes (each under ``spec``, or free)."""
    from compute.engine import Engine
    from compute.sampling import SamplingParams
    from compute.sequence import Sequence

    eng = Engine.for_model(model, num_blocks=sum(-(-(len(p) + tokens) // 16) for p in prompts) + 64)
    for p in prompts:
        seq = Sequence(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=spec is None, grammar=spec))
        seq.matcher = grammars.matcher(spec) if spec is not None else None
        eng.scheduler.add(seq)
    steps = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        if eng.last_step == (len(prompts), 0):
            steps.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(steps)


def _mask_us(grammars, bundle, spec: dict, n: int, calls: int = 50) -> float:
    """us of one mask of ``n`` rows (``compute.grammar.mask_logits``), matchers a few tokens into their grammar."""
    import torch

    from compute.grammar import mask_logits

    start = {"json_schema": '{"answer":"', "regex": "Hello", "lark": '<tool_call>\n{"name":"search","arguments":{"query":"'}
    matchers = []
    for _ in range(n):
        m = grammars.matcher(spec)
        m.consume_tokens(bundle.encode(start[spec["type"]]))
        matchers.append(m)
    x = torch.zeros(n, grammars.vocab_size)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        mask_logits(x, matchers)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _print_table(med: dict, names: list[str], cpu: str) -> None:
    print(f"CPU: {cpu}")
    print("| streams | free (ms/step) | " + " | ".join(f"{g} (ms/step)" for g in names) + " | "
          + " | ".join(f"{g} / free" for g in names) + " | " + " | ".join(f"mask {g} (us)" for g in names) + " |")  # fmt: skip
    print("|" + "---|" * (2 + 3 * len(names)))
    for n in STREAMS:
        free = med[f"free/{n}"]
        cells = [f"{med[f'{g}/{n}']:.1f}" for g in names] + [f"{med[f'{g}/{n}'] / free:.2f}x" for g in names]
        cells += [f"{med[f'mask {g}/{n}']:.0f}" for g in names]
        print(f"| {n} | {free:.1f} | " + " | ".join(cells) + " |")
