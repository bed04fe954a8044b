"""`pdserve chat "question"`: one chat request through the gateway, the answer streamed to stdout; on stderr, the
speed it got (tokens from the stream's usage, time to the first token, tokens per second after it)."""

from __future__ import annotations

import json
import sys
import time

MAX_ATTEMPTS = 64  # 503/429 retries, each after the gateway's Retry-After, all within --wait


def add_arguments(p) -> None:
    p.add_argument("question")
    p.add_argument("--url", default=None, help="the gateway (default: [gateway] url of the config file, else "
                   "http://127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the config file (else $PDSERVE_CONFIG)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the service to be ready and "
                   "to answer (a 503/429 with Retry-After is retried within them)")


def _retry_after(r) -> float | None:
    try:
        return min(max(float(r.headers["Retry-After"]), 0.1), 30.0)
    except (KeyError, ValueError):
        return None


def wait_ready(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise OSError(f"the gateway at {url} is not ready after {timeout:g} s")


def main(args) -> int:
    from gateway.main import gateway_url
    from paramstore.config import config_path, env_secret, read_config

    args.url = gateway_url(read_config(config_path(args.config)), args.url)
    wait_ready(args.url, args.wait)
    headers = {}
    key = (env_secret("PDSERVE_API_KEYS") or "").split(",")[0].strip()  # or $PDSERVE_API_KEYS_FILE
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": args.model, "messages": [{"role": "user", "content": args.question}],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    deadline = time.monotonic() + args.wait
    for attempt in range(MAX_ATTEMPTS):
        rc = _ask(args.url, body, headers, deadline, attempt)
        if rc is not None:
            return rc
    print(f"pdserve chat: no answer after {MAX_ATTEMPTS} tries", file=sys.stderr)
    return 2


def _ask(url: str, body: dict, headers: dict, deadline: float, attempt: int) -> int | None:
    """One try: the exit code, or None to retry (a 503/429 with Retry-After that fits before the deadline)."""
    import httpx

    t0, first, last, tokens = time.monotonic(), None, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            wait = _retry_after(r)
            if r.status_code in (429, 503) and wait is not None and time.monotonic() + wait < deadline:
                if attempt == 0:  # one progress line, then quiet retries (as the openai client's)
                    left = deadline - time.monotonic()
                    print(f"pdserve chat: {r.status_code} ({msg}); retrying for up to {left:.0f} s", file=sys.stderr)
                time.sleep(wait)
                return None
            print(f"pdserve chat: error {r.status_code}: {msg}", file=sys.stderr)
            return 2
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"\npdserve chat: error: {chunk['error']['message']}", file=sys.stderr)
                return 1
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    first, last = first or time.monotonic(), time.monotonic()
                sys.stdout.write(ch.get("delta", {}).get("content") or "")
                sys.stdout.flush()
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    print()
    if tokens and first is not None:
        rate = f", {(tokens - 1) / (last - first):.1f} tok/s after it" if tokens > 1 and last > first else ""
        print(f"pdserve chat: {tokens} tokens, the first after {first - t0:.2f} s{rate}", file=sys.stderr)
    return 0
