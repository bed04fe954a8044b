"""`pdserve bench store`: import and load throughput of the parameter store, against its limits.

Same run, interleaved, medians of `--repeat` runs, for SmolLM2-135M (bf16 from the
real GGUF) and a synthetic Llama-shaped model of ~1 GiB in bf16:
  - import throughput (source bytes / s) beside zfec's raw encode rate;
  - load throughput from a warm local store with 0, 1 and 3 data fragments missing
    per shard, beside (a) ``safetensors.torch.load_file`` of the bf16 checkpoint
    with every byte touched and (b) raw ``readinto`` of the same stored data
    fragments into one preallocated buffer (the limit), and zfec's decode rate.
Prints a table (ours vs baseline as a ratio) and writes JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from paramstore.codec import ErasureCodec
from paramstore.config import StoreConfig
from paramstore.reader import ReaderConfig
from paramstore.store import ParamStore

GB = 1e9


@dataclass(slots=True)
class BenchConfig:
    """Knobs of the store benchmark."""

    out: str = "bench-results/store.json"  # JSON report path
    workdir: str | None = None  # scratch space (default: a temp dir, removed after)
    repeat: int = 3  # runs per measurement (median reported)
    synthetic_layers: int = 11  # 11 TinyLlama-shaped blocks + embedding ~ 1.1 GB in bf16
    skip_synthetic: bool = False
    k: int = 8
    m: int = 3

    def __post_init__(self) -> None:
        if self.repeat < 1 or self.synthetic_layers < 1 or self.k < 1 or self.m < 3:
            raise ValueError("repeat >= 1, synthetic_layers >= 1, k >= 1, m >= 3 (3 losses are measured)")


def _median_rate(fn, nbytes: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / GB


def synthetic_checkpoint(folder: str, layers: int) -> int:
    """A TinyLlama-shaped bf16 checkpoint (hidden 2048, ffn 5632, 32 heads / 4 KV heads); returns bytes."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 5632, "num_hidden_layers": layers, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 2048, "vocab_size": 32000, "tie_word_embeddings": True,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(0)
    h, ffn, kv = 2048, 5632, 4 * 64
    shapes = {"model.embed_tokens.weight": (32000, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
    tensors = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return sum(t.numel() * 2 for t in tensors.values())


def smollm2_checkpoint(folder: str) -> int:
    """SmolLM2-135M from the real GGUF, saved as a bf16 HF folder; returns bytes."""
    from safetensors.torch import save_file

    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    src = open_source(gguf_path())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(src.config, f)
    for name, data in src.files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    tensors = {n: t.to(torch.bfloat16).contiguous() for n, t in src.iter_tensors()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return sum(t.numel() * 2 for t in tensors.values())


def _touch_all(path: str) -> None:
    from safetensors.torch import load_file

    for t in load_file(path).values():
        t.view(torch.uint8).max()  # every byte touched


class _Hider:
    """Moves chosen data fragments aside (a lost disk) and puts them back."""

    def __init__(self, store: ParamStore, manifest, lost: int):
        self.moves = []
        for s in manifest.weight_shards():
            for i in range(lost):
                loc = store.location(manifest.locations[s.fragments[i].location])
                src = os.path.join(loc.root, *s.fragment_path(manifest.k, manifest.n, i).split("/"))
                self.moves.append((src, src + ".hidden"))

    def __enter__(self):
        for a, b in self.moves:
            os.replace(a, b)

    def __exit__(self, *exc):
        for a, b in self.moves:
            os.replace(b, a)


def _codec_rates(k: int, m: int, frag: int, repeat: int) -> dict:
    codec = ErasureCodec(k, m)
    buf = bytearray(os.urandom(k * frag))
    view = memoryview(buf)
    frags = codec.encode(view, frag)
    out = {"encode_gbps": _median_rate(lambda: codec.encode(view, frag), len(buf), repeat)}
    for lost in (1, 3):
        blocks = {i: frags[i] for i in range(lost, k + lost)}
        out[f"decode_{lost}_missing_gbps"] = _median_rate(lambda: codec.decode(dict(blocks), frag), len(buf), repeat)
    return out


def bench_model(label: str, folder: str, nbytes: int, root: str, cfg: BenchConfig) -> dict:
    st_path = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    store_cfg = StoreConfig.local_default(os.path.join(root, "store-" + label), k=cfg.k, m=cfg.m)
    res: dict = {"model": label, "bytes": nbytes}
    with ParamStore(store_cfg) as store:
        t0 = time.perf_counter()
        store.import_model(folder, label, dtype="bf16")
        res["import_bf16_gbps"] = nbytes / (time.perf_counter() - t0) / GB
        t0 = time.perf_counter()
        store.import_model(folder, label + "-int8", dtype="int8")
        res["import_int8_gbps"] = nbytes / (time.perf_counter() - t0) / GB
        m = store.manifest(label)
        shards = m.weight_shards()
        data_bytes = sum(s.size for s in shards)
        biggest = max(s.fragment_size for s in shards) * m.k
        pool = bytearray(biggest)
        files = [(store.location(m.locations[s.fragments[i].location]), s.fragment_path(m.k, m.n, i), s.fragment_size)
                 for s in shards for i in range(m.k)]  # fmt: skip

        def raw():
            mv = memoryview(pool)
            for loc, rel, size in files:
                loc.readinto(rel, mv[:size])

        def ours(reuse: bool):
            def run():
                with store.reader(m, ReaderConfig(prefetch=0 if reuse else 2)) as r:
                    for s in shards:
                        r.read(s, out=pool if reuse else None)
            return run

        raw(), ours(True)(), _touch_all(st_path)  # warm the page cache
        rates = {"raw_readinto": [], "safetensors_load_file": [], "ours_reused_buffer": [], "ours_fresh_buffers": []}
        for _ in range(cfg.repeat):  # interleaved: the box is shared
            rates["raw_readinto"].append(_median_rate(raw, data_bytes, 1))
            rates["safetensors_load_file"].append(_median_rate(lambda: _touch_all(st_path), nbytes, 1))
            rates["ours_reused_buffer"].append(_median_rate(ours(True), data_bytes, 1))
            rates["ours_fresh_buffers"].append(_median_rate(ours(False), data_bytes, 1))
        res.update({k + "_gbps": statistics.median(v) for k, v in rates.items()})
        for lost in (1, 3):
            with _Hider(store, m, lost):
                res[f"ours_{lost}_missing_gbps"] = _median_rate(ours(True), data_bytes, cfg.repeat)
        res |= _codec_rates(m.k, m.m, max(s.fragment_size for s in shards), cfg.repeat)
    return res


def print_table(results: list[dict]) -> None:
    hdr = f"{'model':10} {'measurement':38} {'GB/s':>7} {'baseline':28} {'GB/s':>7} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        rows = [
            ("import bf16 (quantize=none)", r["import_bf16_gbps"], "zfec encode", r["encode_gbps"]),
            ("import int8", r["import_int8_gbps"], "zfec encode", r["encode_gbps"]),
            ("load, 0 missing, reused buffer", r["ours_reused_buffer_gbps"], "raw readinto (limit)", r["raw_readinto_gbps"]),
            ("load, 0 missing, fresh buffers", r["ours_fresh_buffers_gbps"], "safetensors load_file", r["safetensors_load_file_gbps"]),
            ("load, 0 missing, reused buffer", r["ours_reused_buffer_gbps"], "safetensors load_file", r["safetensors_load_file_gbps"]),
            ("load, 1 data fragment missing", r["ours_1_missing_gbps"], "zfec decode, 1 missing", r["decode_1_missing_gbps"]),
            ("load, 3 data fragments missing", r["ours_3_missing_gbps"], "zfec decode, 3 missing", r["decode_3_missing_gbps"]),
        ]  # fmt: skip
        for what, ours, base, b in rows:
            print(f"{r['model']:10} {what:38} {ours:7.2f} {base:28} {b:7.2f} {ours / b:6.2f}")


def run(cfg: BenchConfig) -> dict:
    torch.set_num_threads(2)
    root = cfg.workdir or tempfile.mkdtemp(prefix="pdserve-bench-")
    results = []
    try:
        folder = os.path.join(root, "smollm2-bf16")
        results.append(bench_model("smollm2", folder, smollm2_checkpoint(folder), root, cfg))
        if not cfg.skip_synthetic:
            folder = os.path.join(root, "synthetic-1g")
            results.append(bench_model("synth-1g", folder, synthetic_checkpoint(folder, cfg.synthetic_layers), root, cfg))
    finally:
        if cfg.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(results)
    report = {"bench": "store", "k": cfg.k, "m": cfg.m, "repeat": cfg.repeat, "cpus": os.cpu_count(),
              "torch": torch.__version__, "results": results}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    with open(cfg.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {cfg.out}")
    return report


def add_arguments(p) -> None:
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench-results/store.json")
    p.add_argument("--workdir", default=None, help="scratch dir (kept); default a temp dir (removed)")
    p.add_argument("--skip-synthetic", action="store_true", help="only SmolLM2, not the ~1 GiB synthetic model")


def main(args) -> int:
    run(BenchConfig(out=args.out, repeat=args.repeat, skip_synthetic=args.skip_synthetic, workdir=args.workdir))
    return 0
