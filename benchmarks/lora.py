"""`pdserve bench lora`: many LoRA adapters on one model, in the engine, against the base alone, same run.

What it measures, on the real SmolLM2 (int8 weights, this machine's kernel plan):
- aggregate decode rate of STREAMS streams (greedy, ``ignore_eos``) when they all run the base, and when they run
  1, 8 and 64 adapters (round robin; ranks 8, 16, 32 and 64 in turn, every decoder linear targeted), interleaved
  over ``--repeat`` rounds: the ratio to the base is the adapters' cost (target: >= 0.8x at 8 adapters);
- a cold adapter: imported into the store as a PEFT directory (``paramstore import-adapter``'s path), then fetched
  and fused as a node does on a miss (``compute/node/adapters.py``), against the same prompt's first token with the
  adapter already kept (target: within 100 ms).
Adapters are random (A ~ N(0, 0.02), B ~ N(0, 0.02)): their cost does not depend on what they learned.
JSON written to ``--out``; the table names the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

RANKS = (8, 16, 32, 64)
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="int8 model in the store (imported from the GGUF if absent)")
    p.add_argument("--adapters", default="1,8,64", help="adapter counts to run beside the base")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per stream")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench-results/lora.json")


def _peft_dir(path: str, config: dict, rank: int, seed: int) -> None:
    """A PEFT adapter directory (what ``save_pretrained`` writes) of random pairs on every decoder linear."""
    import torch
    from safetensors.torch import save_file

    from paramstore.lora import PROJECTIONS, base_shapes

    g = torch.Generator().manual_seed(seed)
    shapes, tensors = base_shapes(config), {}
    for layer in range(config["num_hidden_layers"]):
        for proj in PROJS:
            n, k = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = 0.02 * torch.randn(rank, k, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(n, rank, generator=g)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJS),
                   "bias": "none"}, f)  # fmt: skip


def _weights(config: dict, model_config, rank: int, seed: int):
    """An adapter's fused pairs, as a node holds them, without the store."""
    from compute.modeling.lora import LoraWeights, pair_dtype
    from paramstore.lora import check, read_peft

    with tempfile.TemporaryDirectory() as d:
        _peft_dir(d, config, rank, seed)
        return LoraWeights(check(*read_peft(d), config).targets, model_config, dtype=pair_dtype("int8"))


def _rate(model, prompts: list[list[int]], tokens: int, loras: list) -> float:
    """Aggregate decode tokens per second of ``prompts`` run together, stream i under ``loras[i]``."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.engine.sequence import Sequence

    eng = Engine.for_model(model, num_blocks=sum(-(-(len(p) + tokens) // 16) + 1 for p in prompts) + 16,
                           max_num_seqs=len(prompts), max_num_batched_tokens=4096)  # fmt: skip
    for p, w in zip(prompts, loras):
        seq = Sequence(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        seq.lora = w
        eng.add(seq)
    eng.step()  # every prompt prefilled in one step: what follows is decode
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0)


def _first_token(model, prompt: list[int], lora) -> float:
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams
    from compute.engine.sequence import Sequence

    eng = Engine.for_model(model, num_blocks=64, max_num_batched_tokens=4096)
    seq = Sequence(prompt, SamplingParams(max_tokens=1, temperature=0))
    seq.lora = lora
    t0 = time.perf_counter()
    eng.add(seq)
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.common import cpu_flags, cpu_model, ensure_model
    from compute.modeling.loader import WeightInjector
    from compute.modeling.lora import LoraWeights, pair_dtype
    from paramstore import ParamStore
    from paramstore.config import store_config

    torch.set_num_threads(args.threads)
    cfg = store_config(args)
    ensure_model(cfg, args.model)
    counts = [int(c) for c in args.adapters.split(",")]
    with ParamStore(cfg) as store:
        inj = WeightInjector(store, args.model, weights="int8", measure="blocking").start()
        inj.wait()
        model, config = inj.model, store.manifest(args.model).config
        adapters = [_weights(config, model.config, RANKS[i % len(RANKS)], seed=i) for i in range(max(counts))]
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.streams)]
        systems = {"base": [None] * args.streams} | {
            f"{c} adapters": [adapters[i % c] for i in range(args.streams)] for c in counts}
        rates: dict[str, list[float]] = {s: [] for s in systems}
        _rate(model, prompts[:4], 4, [None] * 4)  # warm-up
        for _ in range(args.repeat):
            for name, loras in systems.items():
                rates[name].append(_rate(model, prompts, args.tokens, loras))
        # a cold adapter: store -> node (fetch, verify, fuse) -> first token, vs the same adapter kept
        with tempfile.TemporaryDirectory() as d:
            _peft_dir(d, config, 16, seed=999)
            ref = store.import_adapter(d, args.model, "bench-lora-cold").manifest.ref
        try:
            prompt = prompts[0]
            cold, warm = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                adapter = store.adapter(ref)
                w = LoraWeights(adapter.targets, model.config, dtype=pair_dtype("int8"))
                fetched = time.perf_counter() - t0
                cold.append(fetched + _first_token(model, prompt, w))
                warm.append(_first_token(model, prompt, w))
        finally:
            store.remove("bench-lora-cold")
    base = statistics.median(rates["base"])
    rows = {name: {"tok_s": statistics.median(r), "x_base": statistics.median(r) / base, "runs": r}
            for name, r in rates.items()}  # fmt: skip
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    report = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads, "streams": args.streams,
              "tokens": args.tokens, "prompt": args.prompt, "ranks": list(RANKS), "rows": rows,
              "cold_first_token_s": cold_s, "warm_first_token_s": warm_s, "cold_extra_s": cold_s - warm_s,
              "meets_target": {"aggregate_8_adapters_ge_0.8x": rows.get("8 adapters", {}).get("x_base", 0) >= 0.8,
                               "cold_within_100ms": cold_s - warm_s <= 0.1}}  # fmt: skip
    print(f"LoRA adapters, {args.streams} streams x {args.tokens} tokens, {args.threads} threads, {cpu_model()}")
    print(f"{'system':14} {'tok/s':>8} {'x base':>7}")
    for name, r in rows.items():
        print(f"{name:14} {r['tok_s']:8.1f} {r['x_base']:7.2f}")
    print(f"first token: cold adapter {cold_s * 1e3:.0f} ms (store -> fused -> token), kept {warm_s * 1e3:.0f} ms: "
          f"+{(cold_s - warm_s) * 1e3:.0f} ms")  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
