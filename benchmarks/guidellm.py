"""`pdserve bench guidellm`: a load-testing client made for OpenAI-compatible servers, run against the gateway.

    make eval-deps        # .venv-eval: lm-eval and guidellm 0.8.1 (their own venv)
    pdserve bench guidellm [--streams 1,4,8] [--requests 24] [--out bench-results/guidellm.json]

Why guidellm (vLLM's own benchmark client): it drives /v1/completions with synthetic prompts of an exact
token length made with the model's tokenizer (given locally: no hub), in a concurrency profile, and
reports TTFT, inter-token latency and throughput per concurrency level. aiperf pulls dash, kaleido and
ffmpeg; inference-perf is not on PyPI.

`pdserve up` serves SmolLM2 (int8) on one prefill and one decode node (as `make demo`), 1 thread each;
for each concurrency level guidellm sends ``--requests`` requests of 128 prompt tokens and 64 output
tokens; its JSON report is kept and summarised.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--guidellm", default=".venv-eval/bin/guidellm", help="the guidellm command (make eval-deps)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--streams", default="1,4,8", help="concurrency levels")
    p.add_argument("--requests", type=int, default=24, help="requests per level")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node (pdserve up's default: 1)")
    p.add_argument("--out", default="bench-results/guidellm.json")


def main(args: argparse.Namespace) -> int:
    from benchmarks.lm_eval import _tokenizer_folder
    from benchmarks.service import UpService
    from paramstore import ParamStore
    from paramstore.config import store_config

    tool = os.path.abspath(args.guidellm)
    if not os.path.exists(tool):
        raise ValueError(f"{args.guidellm} not found: make eval-deps installs guidellm")
    cfg = store_config(args)
    store = ParamStore(cfg)
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok = _tokenizer_folder(store, tmp, args.model)
        up = UpService([args.model], cfg.locations, os.path.join(tmp, "logs"), {"node": {"threads": args.threads}},
                       {"prefill": 1, "decode": 1}, autoscale=False).start()  # fmt: skip
        try:
            up.wait_ready()
            for streams in (int(s) for s in args.streams.split(",")):
                report = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"guidellm-c{streams}")
                cmd = [tool, "run", "--backend", f"kind=openai_http,target={up.url},model={args.model},api_key={up.token}",
                       "--profile", f"kind=concurrent,streams={streams}",
                       "--constraint", f"kind=max_requests,count={args.requests}",
                       "--tokenizer", f"kind=huggingface_auto,model={tok}",
                       "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
                       "--output", f"kind=json,path={report}.json", "--disable-console-interactive"]  # fmt: skip
                env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
                r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900, check=False)
                if r.returncode != 0:
                    raise RuntimeError(f"guidellm failed ({r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
                rows.append({"streams": streams, "command": " ".join(cmd), **_summary(f"{report}.json")})
        finally:
            up.stop()
    print("| concurrency | requests ok | TTFT median (ms) | TTFT p99 (ms) | ITL median (ms) | output tok/s | req/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['streams']} | {r['ok']} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} | "
              f"{r['output_tok_s']:.1f} | {r['req_s']:.2f} |")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def _summary(path: str) -> dict:
    """TTFT, ITL and throughput from guidellm's JSON report (its own statistics)."""
    with open(path) as f:
        rep = json.load(f)
    m = rep["benchmarks"][0]["metrics"]

    def stat(name: str, key: str) -> float:
        d = m[name]["successful"]
        return float(d["percentiles"][key] if key.startswith("p") else d[key])

    return {"ok": int(m["request_totals"]["successful"]) if "request_totals" in m else -1,
            "ttft_ms_p50": stat("time_to_first_token_ms", "p50"), "ttft_ms_p99": stat("time_to_first_token_ms", "p99"),
            "itl_ms_p50": stat("inter_token_latency_ms", "p50"),
            "output_tok_s": stat("output_tokens_per_second", "mean"), "req_s": stat("requests_per_second", "mean")}  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
