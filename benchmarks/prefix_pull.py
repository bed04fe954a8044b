"""`pdserve bench prefix --part scaleup`: new nodes start warm by pulling a peer's cached prefix.

Real node processes (`both`, ``--pool-threads`` threads each): a holder warmed with ``--pull-prefixes`` shared
system prompts of ~``--pool-tokens`` tokens, then two nodes join with empty caches. Each user's request (a
system prompt + a short question) goes to both new nodes, in alternating order (same load on both):

  pull       the gateway's path (gateway/routing/relay.py): the holder's export (POST /internal/kv/export),
             then the request with its handle; the new node pulls the prefix over TCP and computes the rest
  recompute  the request alone: the new node computes the whole prompt (the first time each prefix comes)

TTFT is timed at the client from before the export (pull) or the request (recompute) to the first token.
Reported: the first request of each prefix on a new node (the cold case a scale-up meets), the later ones
(both nodes then hit their own cache), medians and the ratio recompute / pull, and whether greedy answers agree.

``cost`` (run after, same nodes): where the pull's threshold comes from (gateway/routing/router.py ``PullCost``).
For prompts of ``--pull-sizes`` tokens, each distinct from block 0 (no hit anywhere but the holder), interleaved:
TTFT of a pull of the cached prefix vs a recompute on the same new node. A least-squares line over the sizes
gives each: TTFT = a + b * blocks. fixed_s = a_pull - a_recompute (what a pull costs beyond a request),
bytes_per_s = block bytes / b_pull, prefill_tokens_per_s = block tokens / b_recompute, and the break-even size.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time


def run(args, locations: list[str], bundle, policy: str, questions: list[str]) -> dict:
    from benchmarks.prefix_routing import shared_prompts
    from compute.node.launcher import Services

    systems, asks, body = shared_prompts(bundle, policy, questions, args.pool_tokens, args.pull_prefixes,
                                         args.pull_users)  # fmt: skip
    flags = ("--kernels", args.kernels)
    svc = Services(locations, args.model, tempfile.mkdtemp(prefix="pdserve-bench-prefix-scaleup-"))
    try:
        holder = svc.node("both", args.pool_threads, kv_blocks=args.pool_kv_blocks, extra=flags).wait_ready(300)
        for i, s in enumerate(systems):  # the pool is warm: the holder has computed every shared prompt
            _ttft(holder, f"warm-{i}", s + asks[0])
        new = [svc.node("both", args.pool_threads, kv_blocks=args.pool_kv_blocks, extra=flags) for _ in range(2)]
        for n in new:
            n.wait_ready(300)
        out = {"prefixes": len(systems), "users": len(asks), "system_tokens": statistics.median(map(len, systems)),
               "threads_per_node": args.pool_threads, "kernels": args.kernels}  # fmt: skip
        out["scaleup"] = _scaleup(holder, new, systems, asks)
        out["cost"] = _cost(holder, new[0], body, [int(x) for x in args.pull_sizes.split(",")], args.pull_repeat)
    finally:
        svc.stop_all()
    return out


def _scaleup(holder, new: list, systems: list[list[int]], asks: list[list[int]]) -> dict:
    """Node ``new[0]`` pulls, ``new[1]`` recomputes (swapped halfway: neither node's speed decides)."""
    rows = []
    for u, ask in enumerate(asks):
        for i, s in enumerate(systems):
            k = len(rows)
            puller, computer = (new[0], new[1]) if k % 2 == 0 else (new[1], new[0])
            ids = s + ask
            first = u == 0
            order = ("pull", "recompute") if k % 2 == 0 else ("recompute", "pull")
            row = {"prefix": i, "user": u, "first": first}
            for mode in order:
                if mode == "pull":
                    row["pull_s"], row["pull_tokens"], row["pulled_cached"] = _pulled(holder, puller, f"p{k}", ids)
                else:
                    row["recompute_s"], row["recompute_tokens"], row["recompute_cached"] = _ttft(computer, f"c{k}", ids)
            row["same_answer"] = row["pull_tokens"] == row["recompute_tokens"]
            rows.append(row)
            print(f"scaleup prefix {i} user {u}: pull {row['pull_s']:.3f} s (cached {row['pulled_cached']}), "
                  f"recompute {row['recompute_s']:.3f} s (cached {row['recompute_cached']})", file=sys.stderr, flush=True)
    out = {"rows": rows}
    for name, sel in (("first", [r for r in rows if r["first"]]), ("later", [r for r in rows if not r["first"]])):
        if sel:
            p, c = statistics.median(r["pull_s"] for r in sel), statistics.median(r["recompute_s"] for r in sel)
            out[name] = {"requests": len(sel), "pull_ttft_p50_s": p, "recompute_ttft_p50_s": c,
                         "recompute_over_pull": c / p, "same_answers": sum(r["same_answer"] for r in sel)}  # fmt: skip
    return out


def _cost(holder, node, body: list[int], sizes: list[int], repeat: int) -> dict:
    """Pull vs recompute TTFT per prompt size on one new node, interleaved; the fitted threshold."""
    rows = []
    for r in range(repeat):
        for j, n in enumerate(sizes):
            idx = r * len(sizes) + j  # a first token of its own: no block of it is cached anywhere but where sent
            pid, cid = [1000 + idx] + body[: n - 1], [3000 + idx] + body[: n - 1]
            _ttft(holder, f"cw-{r}-{n}", pid)  # the holder caches it first (not timed)
            order = [("pull", pid), ("recompute", cid)]
            if r % 2:
                order.reverse()
            row = {"tokens": n, "blocks": (n - 2) // 16}
            for mode, ids in order:
                if mode == "pull":
                    row["pull_s"], _, row["pulled_cached"] = _pulled(holder, node, f"cp-{r}-{n}", ids, row)
                else:
                    row["recompute_s"], _, _ = _ttft(node, f"cc-{r}-{n}", ids)
            rows.append(row)
            print(f"cost {n} tokens: pull {row['pull_s']:.3f} s, recompute {row['recompute_s']:.3f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    med = {}
    for n in sizes:
        sel = [x for x in rows if x["tokens"] == n]
        med[n] = (sel[0]["blocks"], statistics.median(x["pull_s"] for x in sel),
                  statistics.median(x["recompute_s"] for x in sel))  # fmt: skip
    xs = [b for b, _, _ in med.values()]
    a_p, b_p = _fit(xs, [p for _, p, _ in med.values()])
    a_c, b_c = _fit(xs, [c for _, _, c in med.values()])
    block_bytes = _block_bytes(node)
    # the pull's own parts: the export's round trip, and the transfer's time against the bytes it moved
    a_t, b_t = _fit([x["bytes"] for x in rows], [x["transfer_s"] for x in rows])
    export_s = statistics.median(x["export_s"] for x in rows)
    fixed = export_s + max(0.0, a_t)
    rate = 1 / b_t if b_t > 0 else None
    tps = 16 / b_c if b_c > 0 else None
    per_block = block_bytes / rate if rate else 0.0
    out = {"rows": rows, "medians": {str(n): {"blocks": b, "pull_s": p, "recompute_s": c} for n, (b, p, c) in med.items()},
           "block_bytes": block_bytes, "pull_ttft_fit": [a_p, b_p], "recompute_ttft_fit": [a_c, b_c],
           "export_s": export_s, "transfer_fit": [a_t, b_t], "fixed_s": fixed, "bytes_per_s": rate,
           "prefill_tokens_per_s": tps, "end_to_end_fixed_s": a_p - a_c,
           "break_even_blocks": fixed / (16 / tps - per_block) if tps and 16 / tps > per_block else None}  # fmt: skip
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def _block_bytes(node) -> int:
    ld = node.load()
    m = next(iter(ld["models"].values()))
    return m["kv_bytes"] // m["kv_blocks_total"]


def _ttft(node, rid: str, ids: list[int], pull: dict | None = None, t0: float | None = None) -> tuple[float, list, int]:
    """One greedy request of 4 tokens on ``node``: (TTFT from ``t0`` or now, its tokens, its cached_tokens)."""
    import httpx

    body = {"request_id": rid, "prompt_token_ids": ids, "params": {"max_tokens": 4, "temperature": 0}}
    if pull is not None:
        body["pull"] = pull
    t0 = time.perf_counter() if t0 is None else t0
    first, toks, cached = None, [], 0
    with httpx.stream("POST", node.url + "/internal/generate", json=body, auth=node.auth, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            msg = json.loads(line)
            if first is None and msg["token_ids"]:
                first = time.perf_counter() - t0
            toks += msg["token_ids"]
            cached = msg.get("cached_tokens") or cached
    return first, toks, cached


def _pulled(holder, node, rid: str, ids: list[int], parts: dict | None = None) -> tuple[float, list, int]:
    """The gateway's path: the holder's export, then the request with its handle on ``node``. ``parts`` gets the
    export's round trip, the transfer's time on the node (its receiver's metric) and the bytes moved."""
    import httpx

    moved0 = _metric(node, "pdserve_node_peer_pulled_bytes_total")
    took0 = _metric(node, "pdserve_kv_transfer_seconds_sum")
    t0 = time.perf_counter()
    r = httpx.post(holder.url + "/internal/kv/export", json={"prompt_token_ids": ids}, auth=holder.auth, timeout=30)
    t1 = time.perf_counter()
    kv = r.json()["kv"] if r.status_code == 200 else None
    out = _ttft(node, rid, ids, kv, t0)
    if parts is not None:
        parts.update(export_s=t1 - t0, transfer_s=_metric(node, "pdserve_kv_transfer_seconds_sum") - took0,
                     bytes=_metric(node, "pdserve_node_peer_pulled_bytes_total") - moved0)  # fmt: skip
    return out


def _metric(node, name: str) -> float:
    import httpx

    text = httpx.get(node.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))  # fmt: skip


def table(r: dict) -> list[str]:
    out = ["| new node's requests | pull TTFT p50 (s) | recompute TTFT p50 (s) | recompute / pull | same answers |",
           "|---|---|---|---|---|"]
    for name in ("first", "later"):
        m = r["scaleup"].get(name)
        if m:
            out.append(f"| {name} ({m['requests']}) | {m['pull_ttft_p50_s']:.3f} | {m['recompute_ttft_p50_s']:.3f} | "
                       f"{m['recompute_over_pull']:.1f}x | {m['same_answers']}/{m['requests']} |")
    c = r["cost"]
    out += ["", "| prompt tokens | blocks | pull TTFT (s) | recompute TTFT (s) |", "|---|---|---|---|"]
    out += [f"| {n} | {m['blocks']} | {m['pull_s']:.3f} | {m['recompute_s']:.3f} |" for n, m in c["medians"].items()]
    rate = f"{c['bytes_per_s'] / 1e9:.2f} GB/s" if c["bytes_per_s"] else "-"
    tps = f"{c['prefill_tokens_per_s']:.0f}" if c["prefill_tokens_per_s"] else "-"
    be = f"{c['break_even_blocks']:.1f}" if c["break_even_blocks"] is not None else "-"
    out.append(f"\nfit: pull fixed cost {c['fixed_s'] * 1e3:.1f} ms (export {c['export_s'] * 1e3:.1f} ms + transfer "
               f"intercept), link {rate}, prefill {tps} tokens/s, block {c['block_bytes']} bytes: pulling wins from "
               f"{be} blocks; end to end, a pull's TTFT minus a recompute's at 0 blocks: "
               f"{c['end_to_end_fixed_s'] * 1e3:.0f} ms")
    return out
