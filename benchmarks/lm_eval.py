"""`pdserve bench lm-eval`: lm-evaluation-harness scores texts through the gateway; the same numbers in process.

    make eval-deps        # lm-eval 0.4.13 in .venv-eval (its own venv: datasets, evaluate... stay out of .venv)
    pdserve bench lm-eval [--lm-eval .venv-eval/bin/lm_eval] [--out bench-results/lm_eval.json]

1. SmolLM2 is imported as fp32 (``smollm2-fp32``) into the local store if absent, and `pdserve up` serves it
   with fp32 weights (one ``both`` node, 2 threads; the KV cache is fp32 for an all-fp32 runtime);
2. the task (tests/lm_eval/pdserve_licenses.yaml: ``loglikelihood_rolling`` over a local JSON-lines
   file of texts no one here wrote: Debian's license texts, first 1000 tokens each) runs with
   ``--model local-completions`` against the gateway (token-id prompts, ``echo`` + ``logprobs``,
   lm-eval's own requests and parsing), ``--log_samples`` keeping each document's loglikelihood;
3. the same documents are scored in process, from the same fp32 import: pdserve's engine (one forward
   over the KV cache) and HF transformers (``LlamaForCausalLM`` on the same tensors), each over
   lm-eval's own rolling window (its prefix token, the tokenizer's BOS, then the document);
4. the table: per document, lm-eval's loglikelihood and the relative differences (target <= 1e-3).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

TASK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "lm_eval")
TEXTS = ("CC0-1.0", "Apache-2.0", "MPL-2.0", "Artistic")
DOC_TOKENS = 1000  # one rolling window each (lm-eval's max_length is 2048 here)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from paramstore.config import add_store_arguments

    add_store_arguments(p)
    p.add_argument("--lm-eval", default=".venv-eval/bin/lm_eval", help="the lm_eval command (make eval-deps)")
    p.add_argument("--out", default="bench-results/lm_eval.json")


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.baselines import gguf_tensors, hf_llama
    from benchmarks.quality import license_text, logprobs
    from benchmarks.service import UpService
    from compute.modeling.loader import WeightInjector
    from paramstore import NotFound, ParamStore
    from paramstore.config import store_config
    from paramstore.realmodel import gguf_path

    args.lm_eval = os.path.abspath(args.lm_eval)
    if not os.path.exists(args.lm_eval):
        raise ValueError(f"{args.lm_eval} not found: make eval-deps installs lm-evaluation-harness")
    torch.set_num_threads(2)
    cfg = store_config(args)
    store = ParamStore(cfg)
    gguf = gguf_path()
    try:
        store.manifest("smollm2-fp32")
    except NotFound:
        store.import_model(str(gguf), "smollm2-fp32", dtype="fp32")
    inj = WeightInjector(store, "smollm2-fp32", weights="fp32").start()
    inj.wait()
    bundle = inj.bundle
    docs = [bundle.decode(bundle.encode(license_text(n))[:DOC_TOKENS]) for n in TEXTS]
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = _tokenizer_folder(store, tmp)
        with open(os.path.join(tmp, "docs.jsonl"), "w") as f:
            f.writelines(json.dumps({"name": n, "text": t}) + "\n" for n, t in zip(TEXTS, docs))
        up = UpService(["smollm2-fp32"], cfg.locations, os.path.join(tmp, "logs"),
                       {"node": {"threads": 2, "weights": "fp32"}}, {"both": 1, "prefill": 0, "decode": 0},
                       autoscale=False).start()  # fmt: skip
        try:
            up.wait_ready()
            served = _run_lm_eval(args.lm_eval, up, tok_dir, tmp)
        finally:
            up.stop()
    # in process, lm-eval's windows: the prefix token (its tokenizer's EOS) then the document's tokens
    hf = hf_llama(*reversed(gguf_tensors(gguf)), torch.float32)
    prefix = served["prefix_token_id"]
    rows = []
    for name, text in zip(TEXTS, docs):
        ids = [prefix, *bundle.encode(text)]
        ours = float(logprobs(inj.model, ids, len(ids))[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        theirs = float(lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
        got = served["docs"][name]
        rows.append({"doc": name, "tokens": len(ids) - 1, "lm_eval_via_gateway": got, "pdserve_in_process": ours,
                     "hf_transformers": theirs, "rel_vs_pdserve": abs(got - ours) / abs(ours),
                     "rel_vs_hf": abs(got - theirs) / abs(theirs)})  # fmt: skip
    print("| document | tokens | lm-eval via the gateway | pdserve in process | HF transformers | rel. diff vs pdserve | "
          "rel. diff vs HF |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print(f"| {r['doc']} | {r['tokens']} | {r['lm_eval_via_gateway']:.4f} | {r['pdserve_in_process']:.4f} | "
              f"{r['hf_transformers']:.4f} | {r['rel_vs_pdserve']:.1e} | {r['rel_vs_hf']:.1e} |")  # fmt: skip
    print(f"lm-eval's metrics: {json.dumps(served['metrics'])}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "metrics": served["metrics"], "command": served["command"]}, f, indent=2)
    print(f"wrote {args.out}")
    worst = max(max(r["rel_vs_pdserve"], r["rel_vs_hf"]) for r in rows)
    return 0 if worst <= 1e-3 else 1


def _tokenizer_folder(store, tmp: str, model: str = "smollm2-fp32") -> str:
    """The model's tokenizer files from the store, as a folder transformers' AutoTokenizer reads."""
    folder = os.path.join(tmp, "tokenizer")
    os.makedirs(folder)
    with store.reader(store.manifest(model)) as r:
        for name, data in r.bundle().items():
            if name.startswith("tokenizer") or name.endswith(".jinja"):
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(data)
    return folder


def _run_lm_eval(lm_eval: str, up, tok_dir: str, tmp: str) -> dict:
    out = os.path.join(tmp, "lm-eval-out")
    model_args = (f"model=smollm2-fp32,base_url={up.url}/v1/completions,tokenizer={tok_dir},"
                  "tokenizer_backend=huggingface,max_length=2048,num_concurrent=1")  # fmt: skip
    cmd = [lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks", "pdserve_licenses",
           "--include_path", TASK_DIR, "--log_samples", "--output_path", out, "--batch_size", "1"]  # fmt: skip
    env = dict(os.environ, OPENAI_API_KEY=up.token, PDSERVE_DOCS=os.path.join(tmp, "docs.jsonl"),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=1800, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
    samples = glob.glob(os.path.join(out, "**", "samples_pdserve_licenses_*.jsonl"), recursive=True)
    results = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    docs = {}
    with open(samples[0]) as f:
        for line in f:
            s = json.loads(line)
            ll = s["resps"][0][0]
            docs[s["doc"]["name"]] = float(ll[0] if isinstance(ll, list) else ll)
    with open(results[0]) as f:
        res = json.load(f)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return {"docs": docs, "metrics": res["results"]["pdserve_licenses"], "command": " ".join(cmd),
            "prefix_token_id": tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id}  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
