"""The mixed workload of `pdserve bench pd`: chat streams decoding while long prompts arrive.

Fixed by a seed and identical for every configuration: ``--streams`` closed-loop chat streams
(short prompts, ~``--stream-tokens`` new tokens each, lengths varied so streams desynchronise,
starts staggered) run for the duration while long prompts (``--long-min``..``--long-max`` tokens)
arrive about every ``--long-every`` seconds. Each request is streamed through a gateway and timed
at the client: TTFT (request sent -> first chunk), TPOT ((last - first) / (n - 1)), inter-chunk gaps
(ITL) and end to end; ``summary`` gives p50/p99 per class and tokens/s.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

from benchmarks.common import loadavg

STREAM_STAGGER_S = 0.5  # stream i starts at i * this
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does.", "Name a famous painter.", "How many legs does a spider have?",
             "What is photosynthesis?", "Give me a synonym for happy.", "Why is the sky blue?",
             "Tell me a fun fact about owls.", "What does a compiler do?", "Suggest a name for a cat."]  # fmt: skip
_TEXT = ("the of and to in is was for on that with as by at from his it an were are which this be or has had "
         "not first one their its new after but who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can state "
         "about national out known university united then made system river music water mountain history "
         "government between under film series century team season game station group number people country "
         "population language species family village village house north south east west small large local "
         "early late high low public private member members released album song band record company")
WORDS = _TEXT.split()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)



def long_prompt(rng: random.Random, bundle, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += bundle.encode(" ".join(rng.choice(WORDS) for _ in range(n)))
    return ids[:n]



def workload(args, bundle, duration: float) -> dict:
    """The fixed, seeded workload: short chat requests per stream, long prompts with arrival times."""
    rng = random.Random(args.seed)
    lo, hi = max(2, args.stream_tokens // 2), max(2, args.stream_tokens * 3 // 2)  # lengths vary: streams desync
    shorts = [[(rng.choice(QUESTIONS), rng.randint(lo, hi)) for _ in range(400)] for _ in range(args.streams)]
    longs, t = [], 1.0
    while t < duration:
        n = rng.randint(args.long_min, args.long_max)
        longs.append((t, long_prompt(rng, bundle, n)))
        t += rng.uniform(0.5 * args.long_every, 1.5 * args.long_every)
    return {"shorts": shorts, "longs": longs}


async def _one(client, url: str, body: dict, kind: str, t_start: float) -> dict:
    """One streamed request through the gateway; per-chunk timestamps -> TTFT, TPOT, ITL."""
    rec = {"kind": kind, "sent": time.perf_counter() - t_start, "ok": False}
    chunks: list[float] = []
    n_tokens = None
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                msg = json.loads(line[6:])
                if "error" in msg:
                    rec["error"] = str(msg["error"].get("message"))[:200]
                    return rec
                if msg.get("usage"):
                    n_tokens = msg["usage"]["completion_tokens"]
                if msg.get("choices"):
                    ch = msg["choices"][0]
                    text = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
                    if text or ch.get("finish_reason") or not chunks:
                        chunks.append(now)
    except Exception as e:  # noqa: BLE001 - recorded, counted as failed
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
        return rec
    if not chunks or not n_tokens:
        rec["error"] = "no tokens"
        return rec
    rec.update(ok=True, n=n_tokens, ttft=chunks[0] - t0, e2e=chunks[-1] - t0,
               tpot=(chunks[-1] - chunks[0]) / (n_tokens - 1) if n_tokens > 1 else None,
               itl=[b - a for a, b in itertools.pairwise(chunks[1:] if "messages" in body else chunks)])  # fmt: skip
    return rec


async def run_mixed(gw_url: str, wl: dict, args, duration: float, model: str) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    recs: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0, connect=5.0), limits=limits) as client:
        common = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                  "ignore_eos": True}  # fmt: skip
        # warm-up (not measured): one short and one long request
        await _one(client, gw_url, {**common, "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                    "max_tokens": 8}, "warm", time.perf_counter())  # fmt: skip
        await _one(client, gw_url, {**common, "prompt": wl["longs"][0][1], "max_tokens": 2}, "warm",
                   time.perf_counter())  # fmt: skip
        t_start = time.perf_counter()
        end = t_start + duration

        async def stream(i: int):
            await asyncio.sleep(i * STREAM_STAGGER_S)  # staggered starts
            for q, n in wl["shorts"][i]:
                if time.perf_counter() >= end:
                    return
                recs.append(await _one(client, gw_url, {**common, "messages": [{"role": "user", "content": q}],
                                                         "max_tokens": n}, "short", t_start))  # fmt: skip

        async def longs():
            tasks = []
            for at, prompt in wl["longs"]:
                delay = t_start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= end:
                    break
                tasks.append(asyncio.create_task(_one(client, gw_url, {**common, "prompt": prompt,
                                                                       "max_tokens": args.long_new}, "long", t_start)))  # fmt: skip
            for t in tasks:
                recs.append(await t)

        load0 = loadavg()
        await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(args.streams)), longs()),
                               timeout=duration + 150)  # fmt: skip
        wall = time.perf_counter() - t_start
    return {"records": recs, "wall_s": wall, "loadavg_before": load0, "loadavg_after": loadavg()}


def summary(run: dict) -> dict:
    recs = run["records"]
    out = {"wall_s": run["wall_s"], "loadavg_before": run["loadavg_before"], "loadavg_after": run["loadavg_after"]}
    ok = [r for r in recs if r["ok"]]
    out["requests"] = len(recs)
    out["failed"] = len(recs) - len(ok)
    out["errors"] = sorted({r.get("error", "") for r in recs if not r["ok"]})[:5]
    out["generated_tokens"] = sum(r["n"] for r in ok)
    out["tokens_per_s"] = out["generated_tokens"] / run["wall_s"]
    for kind in ("short", "long"):
        rs = [r for r in ok if r["kind"] == kind]
        ttft = [r["ttft"] for r in rs]
        tpot = [r["tpot"] for r in rs if r["tpot"] is not None]
        itl = [g for r in rs for g in r["itl"]]
        e2e = [r["e2e"] for r in rs]
        out[kind] = {"n": len(rs), "failed": len([r for r in recs if r["kind"] == kind and not r["ok"]]),
                     **{f"{m}_p{int(q * 100)}": _pct(xs, q) for m, xs in (("ttft", ttft), ("tpot", tpot),
                                                                             ("itl", itl), ("e2e", e2e))
                        for q in (0.5, 0.99)}}  # fmt: skip
    return out


def mixed_table(res: dict, args, duration: float) -> str:
    c, d = res["colocated"], res["disaggregated"]
    lines = [(f"Mixed workload, {duration:g} s each, seed {args.seed}: {args.streams} chat streams x "
              f"~{args.stream_tokens} tokens + long prompts ({args.long_min}-{args.long_max} tokens, "
              f"{args.long_new} new) every ~{args.long_every:g} s"),
             (f"colocated: 1 both node --threads 2 | disaggregated: prefill + decode nodes --threads 1 each "
              f"({res['transport']}); client-side, through each gateway, streaming"),
             f"{'class':<6} {'metric':<10} {'colocated':>10} {'disagg':>10} {'disagg/col':>10}"]  # fmt: skip
    for kind in ("short", "long"):
        for m in ("ttft", "tpot", "itl", "e2e"):
            for q in ("p50", "p99"):
                k = f"{m}_{q}"
                a, b = c[kind][k], d[kind][k]
                ratio = f"{b / a:>10.2f}" if a and b else f"{'-':>10}"
                fa = f"{a * 1e3:>8.1f}ms" if a is not None else f"{'-':>10}"
                fb = f"{b * 1e3:>8.1f}ms" if b is not None else f"{'-':>10}"
                lines.append(f"{kind:<6} {m.upper() + ' ' + q:<10} {fa} {fb} {ratio}")
    for kind in ("short", "long"):
        lines.append(f"{kind:<6} {'requests':<10} {c[kind]['n']:>10} {d[kind]['n']:>10} "
                     f"{d[kind]['n'] / max(c[kind]['n'], 1):>10.2f}")  # fmt: skip
    lines.append(f"{'all':<6} {'tokens/s':<10} {c['tokens_per_s']:>10.1f} {d['tokens_per_s']:>10.1f} "
                 f"{d['tokens_per_s'] / max(c['tokens_per_s'], 1e-9):>10.2f}")  # fmt: skip
    lines.append(f"{'all':<6} {'failed':<10} {c['failed']:>10} {d['failed']:>10}")
    lines.append(f"{'nodes':<6} {'CPU cores':<10} {c['node_cpu_cores']:>10.2f} {d['node_cpu_cores']:>10.2f} "
                 f"{d['node_cpu_cores'] / max(c['node_cpu_cores'], 1e-9):>10.2f}")  # fmt: skip
    lines.append(f"{'':<6} {'load avg':<10} {c['loadavg_before'] or 0:>4.1f}->{c['loadavg_after'] or 0:<4.1f} "
                 f"{d['loadavg_before'] or 0:>4.1f}->{d['loadavg_after'] or 0:<4.1f}  (1-min, whole box)")  # fmt: skip
    return "\n".join(lines)


