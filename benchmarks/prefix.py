"""`pdserve bench prefix`: what the engine's prefix cache gives and costs, on the real model, in process.

    pdserve bench prefix [--store URL ...] [--model smollm2] [--kernels measured|invariant] [--repeat 3]
                         [--prefix-tokens 1500] [--conversations 8] [--turns 8] [--out bench-results/prefix.json]

Same run, interleaved, medians and ratios:

1. repeated prefix: a ~1,500-token system prompt and a short question; TTFT of a request whose prefix is
   cached (hit) vs one with the same tokens that misses (another ``cache_salt``: the same work, no block in
   common), alone on the engine; ratio miss / hit (target >= 5x). Whether the greedy answers agree is
   reported too (bit-for-bit only promised under ``--kernels invariant``).
2. 0% hits: distinct prompts (random tokens from the first: not even the chat template in common) run to
   completion with the cache on and off: two fresh engines with the same requests, stepped alternately and
   each step timed (a paired measurement: the shared box's load falls on both); throughput (prompt + output
   tokens / engine-seconds), the cost 1 - on / off (median of the repeats' ratios; target <= 1%), and the
   share of the time spent in the cache's own calls (hashing, lookup, publish).
3. multi-turn: ``--conversations`` chats of ``--turns`` turns over one ~600-token system prompt, each turn
   appending the answer (``--answer-tokens``) and a new question; a turn's requests start together; TTFT
   per turn (median over the conversations), cache on vs off; turn N / turn 2 (target <= 1.15 at turn 8).

Prefill chunks are the node's default (512 tokens a step). If the store lacks ``--model`` it is imported first.

``--part routing`` runs the pool scenario instead (shared system prompts through a real gateway and 2 nodes:
routing by cache vs by load vs cache off), ``--part weights`` the router's weight measurement (both:
benchmarks/prefix_routing.py), ``--part scaleup`` new nodes pulling a peer's cached prefixes vs recomputing them,
and the pull's cost fit (benchmarks/prefix_pull.py), ``--part all`` everything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does.", "Name a famous painter.", "How many legs does a spider have?",
             "What is photosynthesis?", "Give me a synonym for happy.", "Why is the sky blue?",
             "What is two plus two?"]  # fmt: skip
POLICY = ("You are the support assistant of a company that sells bicycles, spare parts and repairs. Answer "
          "politely and briefly. Never promise a delivery date. Refunds are possible within 30 days of purchase "
          "when the item is unused and in its original packaging; repairs are guaranteed for six months. ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="int8 model in the store (imported from the GGUF if absent)")
    p.add_argument("--kernels", choices=("measured", "invariant"), default="measured",
                   help="int8 kernel plan (measured: a node's default; invariant: hit == miss bit for bit)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats of parts 1 and 2 (medians reported)")
    p.add_argument("--prefix-tokens", type=int, default=1500, help="part 1: the shared system prompt's tokens")
    p.add_argument("--distinct", type=int, default=8, help="part 2: distinct prompts per run")
    p.add_argument("--distinct-tokens", type=int, default=256, help="part 2: tokens per distinct prompt")
    p.add_argument("--output-tokens", type=int, default=32, help="part 2: new tokens per request")
    p.add_argument("--conversations", type=int, default=8, help="part 3: concurrent conversations (0: skip part 3)")
    p.add_argument("--turns", type=int, default=8, help="part 3: turns per conversation")
    p.add_argument("--answer-tokens", type=int, default=16, help="part 3: tokens per answer")
    p.add_argument("--engine-parts", default="1,2,3", help="--part engine: which of parts 1-3 to run (comma-separated)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--part", choices=("engine", "routing", "weights", "scaleup", "all"), default="engine",
                   help="engine: parts 1-3 in process; routing: the pool scenario; weights: the router's weights; "
                        "scaleup: new nodes pulling a peer's cached prefixes vs recomputing (and the pull's cost)")
    p.add_argument("--pool-prompts", type=int, default=8, help="routing: shared system prompts")
    p.add_argument("--pool-users", type=int, default=3, help="routing: users asking each system prompt")
    p.add_argument("--pool-tokens", type=int, default=1500, help="routing: tokens per system prompt")
    p.add_argument("--pool-clients", type=int, default=2, help="routing: concurrent clients")
    p.add_argument("--pool-threads", type=int, default=1, help="routing: threads per node")
    p.add_argument("--pool-kv-blocks", type=int, default=1024, help="routing: KV blocks per node (16 tokens each)")
    p.add_argument("--pool-roles", choices=("both", "split"), default="both",
                   help="routing: 2 both nodes, or split: 2 prefill + 2 decode nodes")
    p.add_argument("--pool-modes", default="cache,load,off", help="routing: modes, in this order")
    p.add_argument("--pull-prefixes", type=int, default=4, help="scaleup: shared system prompts the pool holds")
    p.add_argument("--pull-users", type=int, default=3, help="scaleup: requests per system prompt on the new nodes")
    p.add_argument("--pull-sizes", default="64,256,512,1024,1500", help="scaleup: prompt sizes of the cost fit")
    p.add_argument("--pull-repeat", type=int, default=2, help="scaleup: interleaved repeats of the cost fit")
    p.add_argument("--out", default="bench-results/prefix.json")


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.common import cpu_flags, ensure_model, loadavg
    from benchmarks.engine import cpu_line
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore
    from paramstore.config import store_config

    torch.set_num_threads(args.threads)
    cfg = store_config(args)
    ensure_model(cfg, args.model)
    if args.part in ("routing", "scaleup"):  # the nodes load the model; this process only needs its tokenizer
        inj = type("NoModel", (), {"model": None, "bundle": None})()
    else:
        with ParamStore(cfg) as store:
            inj = WeightInjector(store, args.model, kernels=args.kernels, measure="blocking").start()
            inj.wait()
    bench = Bench(inj.model, inj.bundle)
    report = {"model": args.model, "kernels": args.kernels, "threads": args.threads, "repeat": args.repeat,
              "cpu": cpu_line(), "cpu_flags": cpu_flags(), "load_average_start": loadavg()}  # fmt: skip
    parts = set(args.engine_parts.split(","))
    if args.part in ("engine", "all"):
        if "1" in parts:
            report["repeated_prefix"] = bench.repeated_prefix(args.prefix_tokens, args.repeat)
            _show("repeated prefix", report["repeated_prefix"])
        if "2" in parts:
            report["zero_hits"] = bench.zero_hits(args.distinct, args.distinct_tokens, args.output_tokens, args.repeat)
            _show("0% hits", report["zero_hits"])
        if "3" in parts and args.conversations > 0:
            report["multi_turn"] = bench.multi_turn(args.conversations, args.turns, args.answer_tokens)
            _show("multi-turn", {k: v for k, v in report["multi_turn"].items() if not isinstance(v, list)})
    if args.part in ("weights", "all"):
        from benchmarks import prefix_routing

        report["router_weights"] = prefix_routing.weights(inj.model, inj.bundle, POLICY, args.prefix_tokens,
                                                          args.repeat)  # fmt: skip
        _show("router weights", report["router_weights"])
    if args.part in ("routing", "all"):
        from benchmarks import prefix_routing

        del inj, bench  # the nodes need the memory and the cores
        report["routing"] = prefix_routing.pool(args, cfg.locations, _bundle(cfg, args.model), POLICY, QUESTIONS)
        print("\n".join(prefix_routing.table(report["routing"])))
    if args.part in ("scaleup", "all"):
        from benchmarks import prefix_pull

        inj = bench = None  # the nodes need the memory and the cores
        report["scaleup"] = prefix_pull.run(args, cfg.locations, _bundle(cfg, args.model), POLICY, QUESTIONS)
        print("\n".join(prefix_pull.table(report["scaleup"])))
    report["load_average_end"] = loadavg()
    if "repeated_prefix" in report:
        _print_table(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _bundle(cfg, model: str):
    from benchmarks.common import bundle

    return bundle(list(cfg.locations), model)


class Bench:
    def __init__(self, model, bundle) -> None:
        self.model, self.bundle = model, bundle

    def engine(self, on: bool, tokens: int):
        from compute.engine.engine import Engine

        return Engine.for_model(self.model, num_blocks=-(-tokens // 16) + 64, prefix_cache=on,
                                max_num_batched_tokens=512, max_num_seqs=64)  # fmt: skip

    def _chat(self, messages: list[dict]) -> list[int]:
        return self.bundle.encode(self.bundle.render_chat(messages))

    def repeated_prefix(self, n_prefix: int, repeat: int) -> dict:
        """TTFT alone of a request whose ~n_prefix-token system prompt is cached vs the same tokens missing."""
        from compute.engine.sampling import SamplingParams

        system = self.bundle.decode((self.bundle.encode(POLICY) * (n_prefix // 40 + 1))[:n_prefix])
        prompts = [self._chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
                   for q in QUESTIONS]  # fmt: skip
        eng = self.engine(True, 4 * max(map(len, prompts)))
        _first_token(eng, prompts[-1], SamplingParams(max_tokens=1, temperature=0, cache_salt="shared"))  # warm it
        hit, miss, same = [], [], []
        for r in range(repeat):
            p = prompts[r % (len(prompts) - 1)]
            for kind in ("miss", "hit") if r % 2 == 0 else ("hit", "miss"):
                salt = "shared" if kind == "hit" else uuid.uuid4().hex
                sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, cache_salt=salt)
                ttft, toks, cached = _first_token(eng, p, sp)
                (hit if kind == "hit" else miss).append((ttft, toks, cached))
            same.append(hit[-1][1] == miss[-1][1])
        out = {"prompt_tokens": statistics.median(len(p) for p in prompts),
               "ttft_miss_s": statistics.median(t for t, _, _ in miss), "ttft_hit_s": statistics.median(t for t, _, _ in hit),
               "cached_tokens_hit": statistics.median(c for _, _, c in hit),
               "samples_miss_s": [t for t, _, _ in miss], "samples_hit_s": [t for t, _, _ in hit],
               "greedy_hit_equals_miss": all(same)}  # fmt: skip
        out["speedup"] = out["ttft_miss_s"] / out["ttft_hit_s"]
        return out

    def zero_hits(self, n: int, n_tokens: int, out_tokens: int, repeat: int) -> dict:
        """Throughput of distinct prompts with the cache on and off: two fresh engines given the same requests,
        stepped alternately (on, off, off, on, ...), each step timed: the box's load falls on both alike."""
        from compute.engine.sampling import SamplingParams

        vocab = self.model.config.vocab_size
        rates: dict[str, list[float]] = {"on": [], "off": []}
        hits, book, wall = 0, 0.0, 0.0
        sp = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
        self.engine(True, 64 * 16).generate([[100 + i for i in range(n_tokens)]], sp)  # warm-up, untimed
        for r in range(repeat):
            rng = random.Random(r)
            prompts = [[rng.randrange(100, vocab) for _ in range(n_tokens)] for _ in range(n)]
            engines = {mode: self.engine(mode == "on", n * (n_tokens + out_tokens + 16)) for mode in ("on", "off")}
            timer = _Timed(engines["on"].scheduler.cache)
            spent = {"on": 0.0, "off": 0.0}
            for eng in engines.values():
                for p in prompts:
                    eng.add_request(p, sp)
            i = 0
            while any(e.has_unfinished() for e in engines.values()):
                for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    if engines[mode].has_unfinished():
                        t0 = time.perf_counter()
                        engines[mode].step()
                        spent[mode] += time.perf_counter() - t0
                i += 1
            for mode in spent:
                rates[mode].append(n * (n_tokens + out_tokens) / spent[mode])
            hits += engines["on"].prefix_cache_stats().hits
            book, wall = book + timer.seconds, wall + spent["on"]
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        ratios = [a / b for a, b in zip(rates["on"], rates["off"])]
        return {"tokens_per_s_on": on, "tokens_per_s_off": off, "cost": 1 - statistics.median(ratios), "hits": hits,
                "bookkeeping_share": book / wall, "samples_on": rates["on"], "samples_off": rates["off"]}  # fmt: skip

    def multi_turn(self, n_conv: int, turns: int, answer_tokens: int) -> dict:
        """TTFT per turn (median over conversations whose turn starts together), cache on vs off, turn by turn
        interleaved (two engines, each its own conversations)."""
        system = self.bundle.decode((self.bundle.encode(POLICY) * 16)[:600])
        out: dict = {"conversations": n_conv, "turns": turns, "answer_tokens": answer_tokens}
        state = {mode: ([[{"role": "system", "content": system}] for _ in range(n_conv)],
                        self.engine(mode == "on", n_conv * (600 + turns * (answer_tokens + 40)) + 64 * 16),
                        [], [], []) for mode in ("on", "off")}  # fmt: skip
        for t in range(turns):
            for mode in ("on", "off") if t % 2 == 0 else ("off", "on"):
                convs, eng, ttft, lens, cached = state[mode]
                for i, c in enumerate(convs):
                    c.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
                prompts = [self._chat(c) for c in convs]
                firsts, answers, hit = _turn(eng, prompts, answer_tokens)
                ttft.append(statistics.median(firsts))
                lens.append(statistics.median(map(len, prompts)))
                cached.append(statistics.median(hit))
                for c, a in zip(convs, answers):
                    c.append({"role": "assistant", "content": self.bundle.decode(a)})
                print(f"multi-turn {mode} turn {t + 1}: TTFT {ttft[-1]:.3f} s, prompt {lens[-1]:.0f}, "
                      f"cached {cached[-1]:.0f}", file=sys.stderr, flush=True)  # fmt: skip
        for mode, (_, _, ttft, lens, cached) in state.items():
            out[f"ttft_{mode}_s"], out["prompt_tokens"], out[f"cached_{mode}"] = ttft, lens, cached
            out[f"last_over_turn2_{mode}"] = ttft[-1] / ttft[1] if turns > 1 else None
        out["last_turn_off_over_on"] = out["ttft_off_s"][-1] / out["ttft_on_s"][-1]
        return out


class _Timed:
    """Wall seconds spent in a ``PrefixCache``'s calls (hashing, lookup, take, publish) of one engine."""

    def __init__(self, cache) -> None:
        self.seconds = 0.0
        for name in ("prepare", "lookup", "take", "computed", "reset"):
            setattr(cache, name, self._wrap(getattr(cache, name)))

    def _wrap(self, fn):
        def timed(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _first_token(eng, prompt: list[int], sp) -> tuple[float, list[int], int]:
    """(TTFT alone, the greedy tokens, cached tokens) of one request run to completion."""
    t0 = time.perf_counter()
    sid, ttft, toks, cached = eng.add_request(prompt, sp), None, [], 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.seq_id == sid and o.new_token_ids:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                cached = o.cached_tokens if o.cached_tokens is not None else cached
                toks += o.new_token_ids
    return ttft, toks, cached


def _turn(eng, prompts: list[list[int]], answer_tokens: int) -> tuple[list[float], list[list[int]], list[int]]:
    """Every prompt added at once, run to completion: per prompt its TTFT, answer and cached tokens."""
    from compute.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp) for p in prompts]
    first: dict[int, float] = {}
    answers: dict[int, list[int]] = {i: [] for i in ids}
    cached: dict[int, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids:
                first.setdefault(o.seq_id, time.perf_counter() - t0)
                answers[o.seq_id] += o.new_token_ids
            if o.cached_tokens is not None:
                cached[o.seq_id] = o.cached_tokens
    return [first[i] for i in ids], [answers[i] for i in ids], [cached.get(i, 0) for i in ids]


def _show(what: str, d: dict) -> None:
    print(f"{what}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()
                                  if not k.startswith("samples")), file=sys.stderr, flush=True)  # fmt: skip


def _print_table(r: dict) -> None:
    print(f"CPU: {r['cpu']} (flags: {' '.join(r['cpu_flags'])}); kernels = {r['kernels']}, {r['threads']} threads")
    rp, z = r.get("repeated_prefix"), r.get("zero_hits")
    print("| measurement | cache off / miss | cache on / hit | ratio |")
    print("|---|---|---|---|")
    if rp:
        print(f"| TTFT, {rp['prompt_tokens']:.0f}-token prompt, {rp['cached_tokens_hit']:.0f} cached (s) | "
              f"{rp['ttft_miss_s']:.3f} | {rp['ttft_hit_s']:.3f} | {rp['speedup']:.1f}x sooner |")
    if z:
        print(f"| 0% hits throughput (tok/s) | {z['tokens_per_s_off']:.1f} | {z['tokens_per_s_on']:.1f} | "
              f"cost {100 * z['cost']:+.2f}% (bookkeeping {100 * z['bookkeeping_share']:.3f}% of the time) |")
    mt = r.get("multi_turn")
    if mt:
        for t in range(mt["turns"]):
            print(f"| multi-turn TTFT turn {t + 1}, prompt {mt['prompt_tokens'][t]:.0f} (s) | {mt['ttft_off_s'][t]:.3f} | "
                  f"{mt['ttft_on_s'][t]:.3f} | {mt['ttft_off_s'][t] / mt['ttft_on_s'][t]:.2f}x |")
        print(f"turn {mt['turns']} / turn 2: on {mt['last_over_turn2_on']:.2f}, off {mt['last_over_turn2_off']:.2f}")
