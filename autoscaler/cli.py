"""`pdserve`: the service CLI — the one place commands are parsed and processes wired.

It sits in the top package of the stack (paramstore < compute < gateway < autoscaler), so
it may dispatch into any of them; each subcommand lives in its own module, imported only
when that subcommand runs:

    pdserve node --role prefill|decode|both --model NAME [...]     a compute node (compute.node.main)
    pdserve gateway [...]                                          the OpenAI-compatible gateway (gateway.main)
    pdserve up [...]                                               the local service: nodes + gateway (autoscaler.up)
    pdserve autoscale --actuator local|kubernetes [...]            the control loop as a process (autoscaler.main)
    pdserve chat "question" / pdserve status                       clients of a running gateway
    pdserve generate --model NAME (--prompt T | --chat T) [...]    offline generation (compute.engine.generate)
    pdserve bench NAME [...]                                       benchmarks (print a table, write JSON)

Every command that runs a component reads the one config file (--config FILE or
$PDSERVE_CONFIG; see paramstore/config.py): flags > environment > file > defaults.
Errors: bad input (flags, config, store) is one line on stderr and exit 2; anything
unexpected one line and exit 1; never a traceback unless PDSERVE_DEBUG=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module providing add_arguments(parser) and main(args) -> int, help)
COMMANDS = {
    "generate": ("compute.engine.generate", "offline one-shot generation from the store"),
    "node": ("compute.node.main", "run a compute node (prefill, decode or both)"),
    "prebuild": ("compute.node.prebuild", "build a model's kernel plan and step packages for this machine class, "
                 "published signed (the publisher key's build job)"),
    "gateway": ("gateway.main", "run the OpenAI-compatible gateway"),
    "up": ("autoscaler.up", "start the local service: nodes + gateway"),
    "autoscale": ("autoscaler.main", "run the autoscaling loop against a gateway (local or kubernetes actuator)"),
    "chat": ("gateway.chat", "send one chat request through the gateway and stream the answer"),
    "status": ("gateway.status", "nodes per role, their state and load, the autoscaler's last decision"),
}
# `pdserve bench NAME` -> (module in benchmarks/, outside the library, help); one row per benchmark
BENCHES = {
    "store": ("benchmarks.store", "parameter store import/load throughput vs its limits"),
    "engine": ("benchmarks.engine", "engine decode/prefill/spawn vs HF transformers"),
    "quality": ("benchmarks.quality", "INT8 vs fp32 weights: perplexity, KL, top-1 on real texts"),
    "pd": ("benchmarks.pd", "KV transfer and colocated vs disaggregated serving"),
    "gateway": ("benchmarks.gateway", "gateway overhead vs a node served directly"),
    "burst": ("benchmarks.burst", "autoscaling under a burst sized from measured capacity, warm pool vs cold"),
    "chaos": ("benchmarks.chaos", "kill -9 a random serving node every 20 s under load: time back to full strength"),
    "swap": ("benchmarks.swap", "many models on one pool: cold-model first token vs a fresh process, from zero"),
    "lm-eval": ("benchmarks.lm_eval", "lm-evaluation-harness scoring through the gateway vs in-process engine and HF"),
    "guidellm": ("benchmarks.guidellm", "guidellm (a load client for OpenAI-compatible servers) against the gateway"),
    "first-start": ("benchmarks.first_start", "launch -> answer on a machine that never ran pdserve vs a warm start"),
    "grammar": ("benchmarks.grammar", "structured output's cost per decode step (JSON schema, regex, tool call) vs free"),
    "weight-copies": ("benchmarks.weight_copies", "batched int8-weight matmuls without a resident bf16 copy vs the copy"),
    "prefix": ("benchmarks.prefix", "prefix cache: TTFT of a repeated prefix hit vs miss, cost at 0% hits, multi-turn TTFT"),
    "kernels": ("benchmarks.kernels", "int8 linears vs this machine's memory bandwidth: the native kernel vs ATen's"),
    "served": ("benchmarks.served", "pdserve's defaults vs llama.cpp's llama-server (Q4_1, Q8_0) on the same GGUF, served"),
    "soak": ("benchmarks.soak", "20-30 min of mixed load, kills and a model swap: growth per hour, back to idle after"),
    "lora": ("benchmarks.lora", "1, 8 and 64 LoRA adapters mixed in one batch vs the base alone; a cold adapter's first token"),
}


def command(*args: str) -> list[str]:
    """The argv that runs `pdserve ARGS...` with this interpreter (for the processes pdserve starts)."""
    return [sys.executable, "-m", "autoscaler.cli", *args]


def _lazy(sub, name: str, module: str, help_: str):
    """A subparser whose arguments come from `module` only if that subcommand is invoked."""
    sp = sub.add_parser(name, help=help_, add_help=False)
    sp.set_defaults(module=module, name=name)
    return sp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="pdserve: elastic, parameter-store-centric LLM serving")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (module, help_) in COMMANDS.items():
        _lazy(sub, name, module, help_)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        _lazy(bsub, name, module, help_)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = build_parser().parse_known_args(argv)
    prog = "pdserve " + (f"bench {args.bench}" if args.cmd == "bench" else args.cmd)
    try:
        mod = importlib.import_module(args.module)
    except ImportError as e:
        print(f"{prog}: not available: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog)
    mod.add_arguments(parser)
    sub_args = parser.parse_args(rest)
    try:
        return int(mod.main(sub_args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, never a traceback (unless debugging)
        if os.environ.get("PDSERVE_DEBUG"):
            raise
        from paramstore.errors import StoreError

        kind = "error" if isinstance(e, (StoreError, ValueError, OSError)) else "internal error"
        print(f"{prog}: {kind}: {e}", file=sys.stderr)
        return 2 if kind == "error" else 1


if __name__ == "__main__":
    raise SystemExit(main())
