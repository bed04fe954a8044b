"""`pdserve generate`: offline generation from the parameter store (like vLLM's ``LLM`` or llama.cpp's CLI).

    pdserve generate --model smollm2 --chat "What is the capital of France?"
    pdserve generate --model smollm2 --prompt "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1
    pdserve generate --model smollm2 --jsonl prompts.jsonl > outputs.jsonl

Lifecycle: open the store (``--store`` URLs, ``--config``, or the local default
``./.pdserve/store``), inject the weights (``compute.modeling.loader.WeightInjector``),
tokenize (``--chat`` goes through the model's chat template), run every request
through one engine (continuous batching), stream the text to stdout as it comes.

``--json`` prints one JSON object instead (token ids, text, finish reason, timings).
``--jsonl FILE`` reads one request per line — a JSON string (a prompt) or an object
with ``prompt`` | ``chat`` | ``messages`` and optional ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop``, ``id`` overriding the flags — runs them all
batched together and prints one JSON line per request, in input order.
Bad input (unknown model, empty prompt, bad JSONL) is a ``ValueError`` or a
``StoreError``: the CLI prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

_PER_REQUEST = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    p.add_argument("--model", required=True, metavar="NAME", help="model name or name@vN in the store")
    add_store_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="raw prompt text (no chat template)")
    src.add_argument("--chat", metavar="TEXT", help="one user message, rendered with the model's chat template")
    src.add_argument("--jsonl", metavar="FILE", help="one request per line ('-' for stdin); prints JSON lines")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--seed", type=int, default=None, help="per-request seed: reproducible sampling")
    p.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S",
                   help="stop strings: the text ends before the first one generated")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    p.add_argument("--weights", choices=("int8", "bf16", "fp32"), default="int8",
                   help="runtime weights (default int8; a float import runs bf16)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache size at most (MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from paramstore import ParamStore
    from paramstore.config import store_config

    requests = _read_requests(args)  # validate input before anything heavy (torch is not imported yet)
    t0 = time.perf_counter()
    with ParamStore(store_config(args)) as store:
        store.manifest(args.model)  # NotFound: one line, exit 2
        import torch

        from compute.engine.engine import Engine
        from compute.engine.stream import TextStream
        from compute.modeling.kv_cache import KVCache
        from compute.modeling.loader import WeightInjector

        injector = WeightInjector(store, args.model, weights=args.weights).start()
        injector.wait()
    t_ready = time.perf_counter()
    model, bundle = injector.model, injector.bundle
    prompts = [_tokenize(bundle, r, i) for i, r in enumerate(requests)]
    params = [_sampling_params(args, r) for r in requests]

    block_size = 16
    per_block = KVCache.bytes_per_block(model.config, block_size, model.dtype)
    need = [-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params)]
    num_blocks = max(max(need), min(sum(need), args.kv_cache_mib * 2**20 // per_block)) + 1
    engine = Engine.for_model(model, num_blocks, block_size=block_size, max_num_seqs=args.max_num_seqs)
    stream = TextStream(engine, bundle)
    with torch.inference_mode():
        ids = [stream.add(p, sp, r.get("stop", args.stop)) for p, sp, r in zip(prompts, params, requests)]
        if args.jsonl:
            _run_jsonl(stream, ids, requests, t_ready - t0)
        elif args.json:
            for _ in stream.run():
                pass
            print(json.dumps(_record(stream.pop_result(ids[0]), t_ready - t0)))
        else:
            for ev in stream.run():
                if ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            r = stream.pop_result(ids[0])
            if r.finish_reason == "error":
                raise RuntimeError(f"generation failed: {r.error}")
    return 0


def _run_jsonl(stream, ids: list[int], requests: list[dict], load_s: float) -> None:
    """Print one JSON line per request, in input order, as soon as it and every earlier one are done."""
    index = {rid: i for i, rid in enumerate(ids)}
    done: dict[int, dict] = {}
    nxt = 0
    for ev in stream.run():
        if not ev.finished:
            continue
        i = index[ev.request_id]
        done[i] = _record(stream.pop_result(ev.request_id), load_s) | {"index": i}
        if "id" in requests[i]:
            done[i]["id"] = requests[i]["id"]
        while nxt in done:
            print(json.dumps(done.pop(nxt)), flush=True)
            nxt += 1


def _record(r, load_s: float) -> dict:
    return {
        "text": r.text,
        "token_ids": r.token_ids,
        "finish_reason": r.finish_reason,
        "stop_string": r.stop_string,
        "prompt_tokens": len(r.prompt_token_ids),
        "completion_tokens": len(r.token_ids),
        "error": r.error,
        "timings": {"load_s": round(load_s, 4), **r.timings()},
    }


def _read_requests(args) -> list[dict]:
    if args.prompt is not None:
        reqs = [{"prompt": args.prompt}]
    elif args.chat is not None:
        reqs = [{"chat": args.chat}]
    else:
        reqs = _read_jsonl(args.jsonl)
    for i, r in enumerate(reqs):
        text = r.get("prompt", r.get("chat"))
        if "messages" not in r and (not isinstance(text, str) or not text.strip()):
            raise ValueError(f"request {i}: empty prompt (a non-empty string is required)")
    return reqs


def _read_jsonl(path: str) -> list[dict]:
    try:
        f = contextlib.nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    reqs = []
    with f as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON: {e.msg}") from None
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if not isinstance(obj, dict) or sum(k in obj for k in ("prompt", "chat", "messages")) != 1:
                raise ValueError(f"{path}:{n}: expected a string or an object with one of prompt, chat, messages")
            if isinstance(obj.get("stop"), str):
                obj["stop"] = [obj["stop"]]
            if not isinstance(obj.get("stop", []), list):
                raise ValueError(f"{path}:{n}: stop must be a string or a list of strings")  # noqa: TRY004
            reqs.append(obj)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def _tokenize(bundle, r: dict, i: int) -> list[int]:
    if "prompt" in r:
        ids = bundle.encode(r["prompt"])
    else:
        messages = r["messages"] if "messages" in r else [{"role": "user", "content": r["chat"]}]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"request {i}: messages must be a list of objects")
        ids = bundle.encode(bundle.render_chat(messages))
    if not ids:
        raise ValueError(f"request {i}: the prompt has no tokens")
    return ids


def _sampling_params(args, r: dict):
    from compute.engine.sampling import SamplingParams

    kw = {k: r.get(k, getattr(args, k)) for k in _PER_REQUEST if k != "stop"}
    try:
        return SamplingParams(**kw, ignore_eos=args.ignore_eos)
    except TypeError as e:
        raise ValueError(f"invalid sampling parameters {kw}: {e}") from None
