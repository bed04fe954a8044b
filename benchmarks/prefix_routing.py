"""`pdserve bench prefix --part routing|weights`: the pool-level parts of the prefix-cache benchmark.

routing — shared system prompts through a real gateway and 2 `both` nodes, or (``--pool-roles split``)
2 prefill + 2 decode nodes: ``--pool-prompts`` system prompts of ~``--pool-tokens`` tokens (distinct from their first token),
each asked by ``--pool-users`` users (a short question appended), in one shuffled order, from
``--pool-clients`` concurrent clients, once per mode, each on fresh nodes (cold caches) and a fresh gateway:

  cache  nodes with their prefix cache, the gateway routing by cache (gateway/routing/router.py)
  load   nodes with their prefix cache, the gateway routing by load only (``--routing load``)
  off    nodes without a prefix cache (``--no-prefix-cache``), routing by load

Reported per mode: TTFT p50/p90 at the client (streamed /v1/completions of token ids), over every request
and over the repeats (a request whose system prompt was asked before in the run); prompt tokens the nodes
computed (``pdserve_node_prompt_tokens_computed_total``) against those they received, and against the ideal
(each system prompt once in the pool, every question once); the gateway's routed_total by hit / load.

weights — where the router's weights come from (docs/gateway.md): on one engine, the TTFT of a prompt alone,
behind a queued prompt of its length (what one queued prompt token costs, in the prompt's own prefill
tokens) and beside ``RUNNING`` streams decoding (what one running stream costs it, in the same unit).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import threading
import time

RUNNING = 48  # weights: streams decoding beside the measured prompt
ROLES = {"both": ("both", "both"), "split": ("prefill", "prefill", "decode", "decode")}  # --pool-roles
MODES = {"cache": ((), ()), "load": ((), ("--routing", "load")), "off": (("--no-prefix-cache",), ("--routing", "load"))}


def shared_prompts(bundle, policy: str, questions: list[str], tokens: int, prompts: int, users: int):
    """-> (``prompts`` system prompts of ``tokens`` tokens, distinct from their first token; ``users`` short
    questions to append; the prompts' shared body), as token ids."""
    base = bundle.encode(policy)
    body = (base * (tokens // max(1, len(base)) + 1))[:tokens]
    systems = [bundle.encode(f"Company {i}: {random.Random(i).randrange(10**6)}. ") + body for i in range(prompts)]
    return systems, [bundle.encode(" Question: " + questions[u % len(questions)]) for u in range(users)], body


def pool(args, locations: list[str], bundle, policy: str, questions: list[str]) -> dict:
    """The routing scenario, every mode in ``--pool-modes`` (in that order)."""
    systems, asks, _ = shared_prompts(bundle, policy, questions, args.pool_tokens, args.pool_prompts, args.pool_users)
    order = [(i, u) for u in range(args.pool_users) for i in range(args.pool_prompts)]
    random.Random(0).shuffle(order)
    ideal = sum(map(len, systems)) + sum(len(asks[u]) for _, u in order)
    out: dict = {"prompts": args.pool_prompts, "users": args.pool_users, "clients": args.pool_clients,
                 "system_tokens": statistics.median(map(len, systems)), "requests": len(order),
                 "ideal_tokens": ideal}  # fmt: skip
    for mode in args.pool_modes.split(","):
        out[mode] = _mode(args, locations, mode, [systems[i] + asks[u] for i, u in order], [i for i, _ in order])
        out[mode]["computed_over_ideal"] = out[mode]["prompt_tokens_computed"] / ideal
        print(f"routing {mode}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in out[mode].items() if k != "samples_s"),
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def _mode(args, locations: list[str], mode: str, prompts: list[list[int]], keys: list[int]) -> dict:
    from compute.node.launcher import Services

    node_flags, gw_flags = MODES[mode]
    svc = Services(locations, args.model, tempfile.mkdtemp(prefix=f"pdserve-bench-prefix-{mode}-"))
    try:
        roles = ROLES[args.pool_roles]
        nodes = [svc.node(role, args.pool_threads, kv_blocks=args.pool_kv_blocks, extra=node_flags)
                 for role in roles]  # fmt: skip
        for n in nodes:
            n.wait_ready(300)
        gw = svc.gateway(list(zip(roles, nodes)), extra=gw_flags).wait_ready(60)
        computed0 = sum(_metric(n.url, "pdserve_node_prompt_tokens_computed_total") for n in nodes)
        t0 = time.perf_counter()
        ttfts = _drive(gw.url, args.model, prompts, args.pool_clients)
        wall = time.perf_counter() - t0
        computed = sum(_metric(n.url, "pdserve_node_prompt_tokens_computed_total") for n in nodes) - computed0
        hits = [_metric(n.url, "pdserve_node_prefix_cache_hits_total") for n in nodes]
        by = {b: _metric(gw.url, "pdserve_gateway_routed_total", f'by="{b}"') for b in ("hit", "load")}
    finally:
        svc.stop_all()
    seen, repeat = set(), []
    for k in keys:
        repeat.append(k in seen)
        seen.add(k)
    rep = [t for t, r in zip(ttfts, repeat) if r]
    received = sum(map(len, prompts))
    return {"ttft_p50_s": _pct(ttfts, 50), "ttft_p90_s": _pct(ttfts, 90), "repeat_ttft_p50_s": _pct(rep, 50),
            "repeat_ttft_p90_s": _pct(rep, 90), "prompt_tokens_received": received, "prompt_tokens_computed": computed,
            "computed_over_received": computed / received, "hit_tokens_per_node": hits, "routed_by": by,
            "wall_s": wall, "samples_s": ttfts}  # fmt: skip


def _drive(gw_url: str, model: str, prompts: list[list[int]], clients: int) -> list[float]:
    """Every prompt once, in order, from ``clients`` threads; -> each one's TTFT (s) at the client."""
    import httpx

    out: list[float | None] = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def client():
        with httpx.Client(timeout=300) as http:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                body = {"model": model, "prompt": prompts[i], "max_tokens": 4, "temperature": 0, "stream": True,
                        "ignore_eos": True}  # fmt: skip
                t0 = time.perf_counter()
                with http.stream("POST", gw_url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data:") and out[i] is None:
                            out[i] = time.perf_counter() - t0
                    assert out[i] is not None, "no token streamed"

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(t is None for t in out):
        raise RuntimeError("a request got no token")
    return out


def weights(model, bundle, policy: str, prompt_tokens: int, repeat: int) -> dict:
    """One engine: the cost of a queued prompt token and of a running stream, in the prompt's prefill tokens."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams

    base = bundle.encode(policy)
    text = (base * (prompt_tokens // len(base) + 2))
    a, b = text[:prompt_tokens], [7] + text[1 : prompt_tokens + 1]

    def engine():
        return Engine.for_model(model, num_blocks=(4 * prompt_tokens) // 16 + 256, prefix_cache=False,
                                max_num_batched_tokens=512, max_num_seqs=64)  # fmt: skip

    def ttft(prompts: list[list[int]], running: int = 0) -> float:
        """The last prompt's first token, the others queued before it, ``running`` streams decoding beside."""
        eng = engine()
        for i in range(running):
            eng.add_request([5 + i] + base[:63], SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
        while eng.scheduler.waiting:
            eng.step()
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t0, ids = time.perf_counter(), [eng.add_request(p, sp) for p in prompts]
        while True:
            if any(o.seq_id == ids[-1] and o.new_token_ids for o in eng.step()):
                return time.perf_counter() - t0

    alone, behind, beside = [], [], []
    for _ in range(repeat):
        alone.append(ttft([a]))
        behind.append(ttft([b, a]))
        beside.append(ttft([a], RUNNING))
    t_alone, t_behind, t_beside = statistics.median(alone), statistics.median(behind), statistics.median(beside)
    per_token = t_alone / prompt_tokens
    return {"prompt_tokens": prompt_tokens, "ttft_alone_s": t_alone, "ttft_behind_one_s": t_behind,
            "ttft_beside_running_s": t_beside, "running": RUNNING,
            "queued_token_over_prompt_token": (t_behind - t_alone) / prompt_tokens / per_token,
            "running_weight": (t_beside - t_alone) / RUNNING / per_token,
            "samples_s": {"alone": alone, "behind": behind, "beside": beside}}  # fmt: skip


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def _metric(url: str, name: str, label: str = "") -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)  # fmt: skip


def table(r: dict) -> list[str]:
    """The routing part as markdown rows."""
    out = ["| mode | TTFT p50 (s) | TTFT p90 (s) | repeats p50 / p90 (s) | prompt tokens computed / received | "
           "computed / ideal | routed by hit / load |", "|---|---|---|---|---|---|---|"]
    def s(x) -> str:  # a time, or "-" where there was none (no repeats with --pool-users 1)
        return "-" if x is None else f"{x:.3f}"

    for mode in MODES:
        m = r.get(mode)
        if m:
            out.append(f"| {mode} | {s(m['ttft_p50_s'])} | {s(m['ttft_p90_s'])} | {s(m['repeat_ttft_p50_s'])} / "
                       f"{s(m['repeat_ttft_p90_s'])} | {m['prompt_tokens_computed']:.0f} / "
                       f"{m['prompt_tokens_received']} "
                       f"({m['computed_over_received']:.2f}) | {m['computed_over_ideal']:.2f}x | "
                       f"{m['routed_by']['hit']:.0f} / {m['routed_by']['load']:.0f} |")  # fmt: skip
    return out
