"""What the node protocol costs per message: msgspec Structs (compute/node/protocol.py) vs pydantic vs the
dict + json path it replaced. Run: ``python -m benchmarks.protocol_codec``.

Two messages, each encoded by one side and decoded by the other: a stream line (paid once per token per
request, on the node and on the gateway) and a generate request of a 200-token prompt (once per attempt),
decoded all the way to the engine's ``SamplingParams``. Times are µs per message, the best of 5 runs.
"""

from __future__ import annotations

import argparse
import json
import timeit
import typing

import pydantic

from compute.engine.sampling import SamplingParams
from compute.node import protocol as P


class _Line(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    error: str | None = None


_Params = pydantic.create_model("_Params", __config__=pydantic.ConfigDict(extra="forbid"), **{
    name: (typ, SamplingParams.__struct_defaults__[i] if i < len(SamplingParams.__struct_defaults__) else ...)
    for i, (name, typ) in enumerate(zip(SamplingParams.__struct_fields__,
                                        typing.get_type_hints(SamplingParams).values(), strict=True))
    if name not in ("logit_bias", "stop_token_ids")}, logit_bias=(dict[int, float], {}),
    stop_token_ids=(tuple[int, ...], ()))  # fmt: skip


class _Generate(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    request_id: str
    prompt_token_ids: list[int]
    params: _Params
    model: str | None = None


def _hand_parse(body: dict) -> SamplingParams:  # the node's parse before the protocol (abridged: same work)
    p = body["params"]
    return SamplingParams(max_tokens=int(p.get("max_tokens", 16)), temperature=float(p.get("temperature", 1.0)),
                          top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", 0) or 0), seed=p.get("seed"),
                          logit_bias={int(t): float(b) for t, b in (p.get("logit_bias") or {}).items()})  # fmt: skip


def measure(n: int = 20000) -> dict[str, tuple[float, float]]:
    sp = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=3, logit_bias={5: 1.0})
    gen = P.GenerateRequest("abc.0", list(range(200)), sp, "m")
    gen_dict = {"request_id": "abc.0", "prompt_token_ids": list(range(200)), "model": "m",
                "params": {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 3, "logit_bias": {5: 1.0}}}
    line, line_dict = P.StreamLine([1234], None), {"token_ids": [1234], "finish_reason": None}
    b_line, b_gen = P.encode_line(line), P.encode(gen)
    pl, pg = _Line(token_ids=[1234], finish_reason=None), _Generate.model_validate_json(b_gen)

    def t(f) -> float:
        return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6

    return {
        "stream line: dict + json": (t(lambda: (json.dumps(line_dict) + "\n").encode()), t(lambda: json.loads(b_line))),
        "stream line: msgspec": (t(lambda: P.encode_line(line)), t(lambda: P.decode(b_line, P.StreamLine))),
        "stream line: pydantic": (t(lambda: pl.model_dump_json().encode()), t(lambda: _Line.model_validate_json(b_line))),
        "generate: dict + json": (t(lambda: json.dumps(gen_dict).encode()),
                                  t(lambda: _hand_parse(json.loads(b_gen)))),
        "generate: msgspec": (t(lambda: P.encode(gen)), t(lambda: P.decode(b_gen, P.GenerateRequest).params)),
        "generate: pydantic": (t(lambda: pg.model_dump_json().encode()),
                               t(lambda: SamplingParams(**_Generate.model_validate_json(b_gen).params.model_dump()))),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000, help="messages per timed run")
    args = ap.parse_args(argv)
    print(f"{'µs per message':28} {'encode':>8} {'decode':>8}")
    for name, (enc, dec) in measure(args.n).items():
        print(f"{name:28} {enc:8.2f} {dec:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
