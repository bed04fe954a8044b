"""`pdserve`: the service CLI. Subcommands load their package lazily.

    pdserve bench store [--repeat N] [--out FILE] [--skip-synthetic]
"""

from __future__ import annotations

import argparse
import os
import sys


def _bench_store(args) -> int:
    from paramstore.bench import BenchConfig, run

    run(BenchConfig(out=args.out or "bench-results/store.json", repeat=args.repeat,
                    skip_synthetic=args.skip_synthetic, workdir=args.workdir))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="pdserve: elastic, parameter-store-centric LLM serving")
    sub = p.add_subparsers(dest="cmd", required=True)
    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    sp = bsub.add_parser("store", help="parameter store import/load throughput vs its limits")
    sp.add_argument("--repeat", type=int, default=3)
    sp.add_argument("--out", default=None)
    sp.add_argument("--workdir", default=None, help="scratch dir (kept); default a temp dir (removed)")
    sp.add_argument("--skip-synthetic", action="store_true", help="only SmolLM2, not the ~1 GiB synthetic model")
    sp.set_defaults(fn=_bench_store)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("pdserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, never a traceback (unless debugging)
        if os.environ.get("PDSERVE_DEBUG"):
            raise
        from paramstore.errors import StoreError

        kind = "error" if isinstance(e, (StoreError, ValueError)) else "internal error"
        print(f"pdserve: {kind}: {e}", file=sys.stderr)
        return 2 if kind == "error" else 1


if __name__ == "__main__":
    raise SystemExit(main())
