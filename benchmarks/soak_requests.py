"""The soak's requests (`pdserve bench soak`): one kind per function, each sent through the gateway with httpx and
checked by what it must give back; ``MIX`` weighs them.

Each returns a record {"kind", "t" (sent, seconds since the soak's t0), "ok", "error" (if not ok), "s" (seconds)}.
A kind's check is its contract, not "HTTP 200": ``n2`` must bring 2 choices, ``grammar`` a JSON object its schema
admits, ``tools`` a call of the named tool with arguments its schema admits, ``responses`` a completed response
with text, ``abort`` 3 chunks before the client hangs up mid-stream (the node must free what the stream held).
"""

from __future__ import annotations

import json
import random
import time

# a long system prompt every "prefix" request shares: its blocks are the prefix cache's and the router's to find
SYSTEM = ("You are a patient assistant for a public library. " * 24).strip()
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "Explain what a CPU does.", "Name a famous painter.", "How many legs does a spider have?",
             "What is photosynthesis?", "Give me a synonym for happy.", "Why is the sky blue?"]  # fmt: skip
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city now",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}}  # fmt: skip
MIX = {"prefix": 4, "plain": 2, "n2": 1, "grammar": 1, "tools": 1, "responses": 1, "abort": 1}  # kind -> weight


async def send(kind: str, client, url: str, model: str, rng: random.Random, t0: float) -> dict:
    rec = {"kind": kind, "model": model, "t": round(time.monotonic() - t0, 2), "ok": False}
    start = time.monotonic()
    try:
        error = await KINDS[kind](client, url, model, rng)
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        error = f"{type(e).__name__}: {e}"[:200]
    rec["s"] = round(time.monotonic() - start, 3)
    if error:
        rec["error"] = error
    else:
        rec["ok"] = True
    return rec


def _chat(model: str, user: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": user}], "temperature": 0, **extra}


async def _post(client, url: str, path: str, body: dict) -> tuple[dict | None, str | None]:
    r = await client.post(url + path, json=body)
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}: {r.text[:200]}"
    return r.json(), None


async def _stream(client, url: str, body: dict, hang_up_after: int | None = None) -> str | None:
    """A streamed chat; None when it ended with [DONE] and usage (or, with ``hang_up_after``, once that many
    content chunks came: the client closes the connection mid-stream)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks, usage = 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None if usage else "stream ended without usage"
            msg = json.loads(line[6:])
            if "error" in msg:
                return str(msg["error"].get("message", msg["error"]))[:200]
            usage = msg.get("usage") or usage
            chunks += any((c.get("delta") or {}).get("content") for c in msg.get("choices") or [])
            if hang_up_after is not None and chunks >= hang_up_after:
                return None  # leaving the block closes the response: the gateway sees the client gone
    return "stream ended without [DONE]"


async def prefix(client, url, model, rng):
    body = {"model": model, "temperature": 0, "max_tokens": rng.randint(8, 32),
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]}
    return await _stream(client, url, body)


async def plain(client, url, model, rng):
    return await _stream(client, url, _chat(model, rng.choice(QUESTIONS), max_tokens=rng.randint(8, 48)))


async def n2(client, url, model, rng):
    body = {"model": model, "prompt": "Once upon a time", "n": 2, "max_tokens": 12, "temperature": 0.8,
            "seed": rng.randrange(1 << 30)}  # fmt: skip
    out, err = await _post(client, url, "/v1/completions", body)
    return err or (None if len(out["choices"]) == 2 else f"{len(out['choices'])} choices, not 2")


async def grammar(client, url, model, rng):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    out, err = await _post(client, url, "/v1/chat/completions",
                           _chat(model, "Is the sky blue? Answer in JSON.", max_tokens=32, response_format=fmt))  # fmt: skip
    if err:
        return err
    text = out["choices"][0]["message"]["content"]
    try:
        return None if json.loads(text).get("answer") in ("yes", "no") else f"outside the schema: {text[:80]}"
    except ValueError:
        return f"not JSON: {text[:80]}"


async def tools(client, url, model, rng):
    body = _chat(model, "What is the weather in Paris?", max_tokens=48, tools=[TOOL],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    out, err = await _post(client, url, "/v1/chat/completions", body)
    if err:
        return err
    calls = out["choices"][0]["message"].get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "get_weather":
        return f"no call of get_weather: {out['choices'][0]['message']}"[:200]
    args = json.loads(calls[0]["function"]["arguments"])
    return None if args.get("unit") in ("celsius", "fahrenheit") else f"arguments outside the schema: {args}"


async def responses(client, url, model, rng):
    out, err = await _post(client, url, "/v1/responses",
                           {"model": model, "input": rng.choice(QUESTIONS), "max_output_tokens": 16, "temperature": 0})  # fmt: skip
    if err:
        return err
    text = "".join(c.get("text", "") for item in out.get("output", []) for c in item.get("content") or [])
    return None if out.get("status") in ("completed", "incomplete") and text else f"no text: {str(out)[:160]}"


async def abort(client, url, model, rng):
    return await _stream(client, url, _chat(model, "Tell me a long story about a dragon.", max_tokens=200,
                                            ignore_eos=True), hang_up_after=3)  # fmt: skip


KINDS = {"prefix": prefix, "plain": plain, "n2": n2, "grammar": grammar, "tools": tools, "responses": responses,
         "abort": abort}  # fmt: skip
