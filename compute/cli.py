"""`pdserve`: the service CLI. Each subcommand lives in its own module, imported only when used.

    pdserve generate --model NAME (--prompt T | --chat T) [...]   offline generation (compute.generate)
    pdserve node --role prefill|decode|both --model NAME [...]     a compute node (compute.node.server)
    pdserve gateway [...]                                          the OpenAI-compatible gateway (gateway.main)
    pdserve up [...] / pdserve chat "question" / pdserve status     the local service (gateway.up)
    pdserve bench store|engine|quality|pd|gateway|burst                   benchmarks (print a table, write JSON)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module providing add_arguments(parser) and main(args) -> int
COMMANDS = {
    "generate": ("compute.generate", "offline one-shot generation from the store"),
    "node": ("compute.node.main", "run a compute node (prefill, decode or both)"),
    "gateway": ("gateway.main", "run the OpenAI-compatible gateway"),
    "up": ("gateway.up", "start the local service: nodes + gateway"),
    "chat": ("gateway.chat", "send one chat request through the gateway and stream the answer"),
    "status": ("gateway.status", "nodes per role, their state and load, the autoscaler's last decision"),
}
BENCHES = {
    "store": ("paramstore.bench", "parameter store import/load throughput vs its limits"),
    "engine": ("compute.bench_engine", "engine decode/prefill/spawn vs HF transformers"),
    "quality": ("compute.bench_quality", "INT8 vs fp32 weights: perplexity, KL, top-1 on real texts"),
    "pd": ("compute.bench_pd", "KV transfer and colocated vs disaggregated serving"),
    "gateway": ("gateway.bench", "gateway overhead vs a node served directly"),
    "burst": ("autoscaler.bench", "autoscaling under a 10x burst"),
}


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
