"""`pdserve bench quality`: what INT8 weights cost in output quality, on real English texts we did not write.

    pdserve bench quality [--store URL ...] [--max-tokens 2048] [--out bench-results/quality.json]

The real model is imported twice (fp32 and int8, once each) and run through OUR engine's model over
the paged KV cache. Per text: perplexity with fp32 weights (the baseline) and with int8 weights on
both int8 paths — the whole text in one forward (M > 64: dequantize + fp32 matmul) and 64-token
chunks (M <= 64: ``int8mm`` on bf16 inputs, as in decode and chunked prefill) — plus the mean
per-token KL(fp32 || int8) and top-1 agreement of the next-token distributions.

Texts: the Zen of Python (``this``, stdlib) and the license texts in Debian's essential
``base-files`` package (``/usr/share/common-licenses``), where present.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import importlib.util
import json
import math
import os
import sys

import torch

LICENSES = "/usr/share/common-licenses"
LICENSE_TEXTS = ("CC0-1.0", "Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "GFDL-1.3")
DECODE_CHUNK = 64


def zen_of_python() -> str:
    """``this.s`` (rot13), decoded: shipped with every Python."""
    with open(importlib.util.find_spec("this").origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    s = next(n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "s")
    return codecs.decode(s, "rot13")


def license_text(name: str) -> str:
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        return f.read()


def reference_texts() -> dict[str, str]:
    """name -> text: the Zen of Python and the Debian license texts present on this machine."""
    texts = {"zen-of-python": zen_of_python()}
    texts.update({n: license_text(n) for n in LICENSE_TEXTS if os.path.exists(os.path.join(LICENSES, n))})
    return texts


def logprobs(model, ids: list[int], chunk: int, lora=None) -> torch.Tensor:
    """Next-token log-probabilities ``[len(ids), V]`` through our model, ``chunk`` tokens per forward, over
    the KV cache dtype a node serves it with (``auto``: bf16 for int8 weights, fp32 for fp32 weights); ``lora``: a
    LoRA adapter's weights (compute/modeling/lora.py) applied to every row."""
    from compute.modeling.batch import ForwardBatch
    from compute.modeling.kv_cache import KVCache, kv_dtype
    from compute.modeling.lora import LoraRows

    bs = 16
    dtype = kv_dtype("auto", model.dtype, bool(model.kernel_modules()))
    cache = KVCache(model.config, -(-len(ids) // bs), bs, dtype)
    table = list(range(cache.num_blocks))
    out = []
    for start in range(0, len(ids), chunk):
        fb = ForwardBatch.build([ids[start : start + chunk]], [start], [table], bs, all_logits=True)
        fb.lora = LoraRows.of([lora], [len(ids[start : start + chunk])])
        out.append(model(fb, cache).log_softmax(-1))
    return torch.cat(out)


def perplexity(lp: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids[1:]`` under ``lp`` (rows predict the next token)."""
    return math.exp(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def compare(ref: torch.Tensor, lp: torch.Tensor) -> tuple[float, float]:
    """(mean per-token KL(ref || lp), top-1 agreement)."""
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--model", default="smollm2", help="int8 model (imported from the GGUF if absent)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per text at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter of the model (e.g. make demo's "
                   ".pdserve/adapters/pirate): both fp32 and int8 run with it (int8 + adapter vs fp32 + adapter)")
    p.add_argument("--out", default="bench-results/quality.json")


def main(args: argparse.Namespace) -> int:
    from benchmarks.common import ensure_model
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig
    from paramstore.config import store_config

    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    torch.set_num_threads(args.threads)
    cfg = store_config(args)
    ensure_model(cfg, args.model, "int8")
    locations = ensure_model(cfg, args.model + "-fp32", "fp32")
    with ParamStore(StoreConfig(locations=locations)) as store:
        models = {}
        for ref, weights in ((args.model + "-fp32", "fp32"), (args.model, "int8")):
            inj = WeightInjector(store, ref, weights=weights).start()
            inj.wait()  # raises if the load failed
            models[weights] = inj
    bundle = models["fp32"].bundle
    lora = {w: None for w in models}
    if args.adapter:  # the same adapter on both: what int8 weights cost an adapter's output
        from compute.modeling.lora import LoraWeights, pair_dtype
        from paramstore.lora import check, read_peft

        targets = check(*read_peft(args.adapter), models["fp32"].manifest.config).targets
        lora = {w: LoraWeights(targets, inj.model.config, dtype=pair_dtype(w)) for w, inj in models.items()}
    rows = []
    for name, text in reference_texts().items():
        ids = bundle.encode(text)[: args.max_tokens]
        ref = logprobs(models["fp32"].model, ids, len(ids), lora["fp32"])
        row = {"text": name, "tokens": len(ids), "ppl_fp32": perplexity(ref, ids)}
        for path, chunk in (("prefill", len(ids)), ("decode", DECODE_CHUNK)):
            lp = logprobs(models["int8"].model, ids, chunk, lora["int8"])
            kl, top1 = compare(ref, lp)
            row |= {f"ppl_int8_{path}": perplexity(lp, ids), f"kl_{path}": kl, f"top1_{path}": top1}
        rows.append(row)
        _print_row(row, header=len(rows) == 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "adapter": args.adapter, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'text':14s} {'tokens':>6s} {'ppl fp32':>9s} {'int8 prefill':>13s} {'ratio':>7s} "
              f"{'int8 decode':>12s} {'ratio':>7s} {'KL':>7s} {'top-1':>6s}")  # fmt: skip
    print(f"{r['text']:14s} {r['tokens']:6d} {r['ppl_fp32']:9.3f} {r['ppl_int8_prefill']:13.3f} "
          f"{r['ppl_int8_prefill'] / r['ppl_fp32']:7.4f} {r['ppl_int8_decode']:12.3f} "
          f"{r['ppl_int8_decode'] / r['ppl_fp32']:7.4f} {r['kl_prefill']:7.4f} {r['top1_prefill']:6.3f}",
          flush=True)  # fmt: skip
