"""Where one decode step's time goes: the per-step breakdown and the OpenMP options of `pdserve bench engine`.

    breakdown(model, prompts, steps) -> {"step_ms": ..., "parts": {part: ms per step}, "aten_calls": ...}

1. an engine runs ``len(prompts)`` streams to steady decode, then ``steps`` decode steps are timed without a
   profiler: the step's wall time and the model forward's (the runner's model is wrapped by a timer);
2. each timed step is followed by one under ``torch.profiler`` (CPU): each ATen op's *self* time goes to a
   part by its name (``PARTS``): GEMV kernels, attention, KV gather/scatter, conversions/copies,
   norms/RoPE/elementwise, tensor metadata (views, allocations); ``python + dispatch`` is the profiled
   forward's wall time less its ATen self time;
3. a part's figure is its median share of a profiled forward times the unprofiled forward's median (the
   profiler adds ~1 us per op; shares stay put when a shared box's load changes between steps, sums do not);
   ``engine`` (schedule, batch build, sampling) is the step's wall time less the forward's;
4. ``gemv floor``: every int8 linear's kernel called alone in a warm loop on its shape at this M, input already
   in bf16 and aligned (min of runs), summed over the step: what the GEMVs cost without anything around them.

``omp_options`` times the 1-stream step in fresh processes under each OpenMP setting in ``OMP_OPTIONS``
(torch's CPU wheel links GNU OpenMP: ``GOMP_SPINCOUNT`` applies, ``KMP_BLOCKTIME`` does not).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

# ATen op (self time) -> part of the step; anything else is "other aten"
PARTS = {
    "gemv kernels": ("aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::mm", "aten::addmm", "aten::_int_mm"),
    "attention (bmm/softmax, sdpa)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm",
                                      "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
                                      "aten::_softmax", "aten::softmax", "aten::masked_fill_"),  # fmt: skip
    "kv gather/scatter": ("aten::index_select", "aten::index_copy_", "aten::index", "aten::index_put_"),
    "conversions/copies": ("aten::_to_copy", "aten::copy_", "aten::clone", "aten::to", "aten::contiguous"),
    "norms/rope/elementwise": ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::cat",
                               "aten::silu", "aten::neg_", "aten::sin", "aten::cos", "aten::sub", "aten::div",
                               "aten::div_", "aten::where", "aten::sum", "aten::rms_norm", "aten::_fused_rms_norm",
                               "aten::mul_", "aten::add_", "aten::embedding", "aten::silu_", "aten::arange"),
    "metadata (views, allocs)": ("aten::as_strided", "aten::view", "aten::slice", "aten::select", "aten::transpose",
                                 "aten::reshape", "aten::empty", "aten::empty_strided", "aten::empty_like",
                                 "aten::unsqueeze", "aten::narrow", "aten::expand", "aten::flatten", "aten::unbind",
                                 "aten::t", "aten::alias", "aten::detach", "aten::lift_fresh", "aten::_unsafe_view",
                                 "aten::scalar_tensor", "aten::resize_", "aten::result_type", "aten::zeros"),
}
_PART_OF = {op: part for part, ops in PARTS.items() for op in ops}

# name -> (threads, extra environment): measured, not assumed
OMP_OPTIONS = {
    "2 threads (default)": (2, {}),
    "2 threads, OMP_WAIT_POLICY=ACTIVE": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, GOMP_SPINCOUNT=10000000": (2, {"GOMP_SPINCOUNT": "10000000"}),
    "1 thread": (1, {}),
}


class _TimedModel:
    """The runner's model behind a wall-clock timer of each forward."""

    def __init__(self, model) -> None:
        self._model, self.times = model, []

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self._model(*a, **kw)
        self.times.append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def _decode_engine(model, prompts, steps: int):
    """An engine with every prompt prefilled and a few decode steps done (steady state)."""
    from compute.engine.engine import Engine
    from compute.engine.sampling import SamplingParams

    eng = Engine.for_model(model, num_blocks=sum(-(-(len(p) + 3 * steps + 16) // 16) for p in prompts) + 8)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=3 * steps + 8, temperature=0, ignore_eos=True))
    while any(s.num_tokens == s.prompt_len for s in eng.scheduler.seqs.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    return eng


def breakdown(model, prompts, steps: int = 10) -> dict:
    """The per-step breakdown (ms per decode step) of ``len(prompts)`` streams; see the module doc."""
    from torch.profiler import ProfilerActivity, profile

    eng = _decode_engine(model, prompts, steps)
    timed = eng.runner.model = _TimedModel(model)
    walls, shares, calls = [], [], []
    for _ in range(steps):  # a timed step, then a profiled one: both see the same moments of a shared box
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
        n = len(timed.times)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.step()
        fwd = timed.times[n] * 1e6  # us: this profiled step's forward
        part = dict.fromkeys([*PARTS, "other aten"], 0.0)
        count = 0
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                part[_PART_OF.get(e.key, "other aten")] += e.self_cpu_time_total
                count += e.count
        part["python + dispatch"] = max(0.0, fwd - sum(part.values()))
        shares.append({k: v / fwd for k, v in part.items()})
        calls.append(count)
    eng.runner.model = model
    step_ms = statistics.median(walls) * 1e3
    fwd_ms = statistics.median(timed.times[0::2]) * 1e3  # the unprofiled steps' forwards
    # each part: its median share of a profiled forward, times the unprofiled forward (the profiler adds ~1 us
    # per op; a share is robust to the box's load changing between steps, a sum of times is not)
    parts = {k: statistics.median(s[k] for s in shares) * fwd_ms for k in shares[0]}
    parts["engine (schedule, batch, sampling)"] = max(0.0, step_ms - fwd_ms)
    return {"streams": len(prompts), "step_ms": step_ms, "forward_ms": fwd_ms, "parts": parts,
            "aten_calls": int(statistics.median(calls)), "gemv_floor_ms": gemv_floor(model, len(prompts))}  # fmt: skip


def gemv_floor(model, m: int, runs: int = 30) -> float:
    """ms per step of every int8 linear's planned kernel alone, and every int4 linear's int4 kernel (warm loop, bf16
    aligned input, min of runs)."""
    import torch

    from compute.kernels import int4, int8
    from compute.kernels.linear import FusedLinear, Linear

    total = 0.0
    with torch.inference_mode():
        for mod in model.kernel_modules():
            w, scale = mod.int8_weight()
            sb = getattr(mod, "scale_bf16", None)
            sb = sb if sb is not None else mod._scale_act
            plan = mod.plan or ("int8mm",) * len(int8.BUCKETS)
            x = torch.randn(m, w.shape[1]).to(torch.bfloat16)
            name = plan[int8.bucket(m)]
            best = float("inf")
            for _ in range(runs):
                t0 = time.perf_counter()
                int8.run(name, x, w, scale, sb, mod.w_bf16)
                best = min(best, time.perf_counter() - t0)
            total += best
        for mod in model.modules():
            if not isinstance(mod, (Linear, FusedLinear)) or mod.int4_weight() is None:
                continue
            w, sz = mod.int4_weight()
            x = torch.randn(m, sz.shape[0] * int4.GROUP).to(torch.bfloat16)
            best = float("inf")
            for _ in range(runs):
                t0 = time.perf_counter()
                int4.matmul(x, w, sz)
                best = min(best, time.perf_counter() - t0)
            total += best
    return total * 1e3


def format_breakdown(b: dict) -> str:
    lines = [f"decode step, {b['streams']} stream(s): {b['step_ms']:.2f} ms per step (forward {b['forward_ms']:.2f} ms;"
             f" {b['aten_calls']} ATen calls per step; ATen self times from torch.profiler)"]  # fmt: skip
    for part, ms in b["parts"].items():
        lines.append(f"  {part:<36} {ms:7.2f} ms  {ms / b['step_ms']:5.1%}")
    lines.append(f"  {'(gemv floor: kernels alone, warm)':<36} {b['gemv_floor_ms']:7.2f} ms")
    return "\n".join(lines)


_OMP_CHILD = r"""
import json, statistics, time, torch
torch.set_num_threads({threads})
from benchmarks.step_profile import _decode_engine
from compute.modeling.loader import WeightInjector
from paramstore import ParamStore, StoreConfig
inj = WeightInjector(ParamStore(StoreConfig(locations={locations!r})), {model!r}, weights="int8").start()
inj.wait()
b = inj.bundle
prompt = b.encode(b.render_chat([{{"role": "user", "content": "What is the capital of France?"}}]))
out = {{}}
for n in {streams!r}:
    eng = _decode_engine(inj.model, [prompt] * n, {steps})
    ts = []
    for _ in range({steps}):
        t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
    out[n] = statistics.median(ts) * 1e3
print(json.dumps(out))
"""


def omp_options(locations, model: str, streams=(1, 32), steps: int = 15) -> dict[str, dict]:
    """Step ms per stream count under each ``OMP_OPTIONS`` entry, each in a fresh process (env is read at start)."""
    out = {}
    for name, (threads, extra) in OMP_OPTIONS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(extra, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
        code = _OMP_CHILD.format(threads=threads, locations=list(locations), model=model, streams=tuple(streams),
                                 steps=steps)  # fmt: skip
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            out[name] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        out[name] = {f"step_ms_{k}": v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
        print(f"omp option {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def weight_bytes(model) -> dict[str, int]:
    """Runtime weight bytes by kind: int8 weights, int4 codes (uint8, two per byte), the bf16 copies a measured plan
    keeps (``w_bf16``), and the rest (scales, int4 scale/zero tables, norms, float weights); each tensor once (fused buffers and their parts' views, tied weights)."""
    import torch

    from compute.kernels.linear import LinearPart

    seen, out = set(), {"int8": 0, "int4": 0, "bf16 copies": 0, "other": 0}
    for mod in model.modules():
        if isinstance(mod, LinearPart):
            continue  # views of its FusedLinear's buffers
        tensors = [*mod._buffers.values(), *(v for v in vars(mod).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is None or t.is_meta or (t.data_ptr(), t.nbytes) in seen:
                continue
            seen.add((t.data_ptr(), t.nbytes))
            kind = {torch.int8: "int8", torch.uint8: "int4"}.get(t.dtype, "other")
            kind = "bf16 copies" if t is getattr(mod, "w_bf16", None) else kind
            out[kind] += t.nbytes
    return out


def report(models: dict, chats: list[list[int]], locations, ref: str, steps: bool = True, omp: bool = False) -> dict:
    """What `pdserve bench engine` adds per system of ours (``models``: name -> model): the breakdown at 1 and 32
    streams (``steps``; not for the ``-invariant`` / ``-fixed`` / ``-copies<=`` variants), runtime weight bytes (each
    variant: the default's bf16 copies, ``invariant``'s, none under ``fixed``, the budget's), the OpenMP options
    (``omp``); printed."""
    out: dict = {"breakdown": {}, "weight_bytes": {}}
    for name, model in models.items():
        out["weight_bytes"][name] = weight_bytes(model)
        if steps and not name.endswith(("-invariant", "-fixed")) and "-copies<=" not in name:
            out["breakdown"][name] = [breakdown(model, [chats[i % len(chats)] for i in range(n)]) for n in (1, 32)]
    for name, parts in out["breakdown"].items():
        for b in parts:
            print(f"{name}: " + format_breakdown(b))
    for name, w in out["weight_bytes"].items():
        total = sum(w.values())
        stored = w["int8"] + w["int4"] + w["other"]
        print(f"{name}: runtime weights {total / 2**20:.1f} MiB = {total / max(1, stored):.2f}x "
              f"the stored model ({w['int8'] / 2**20:.1f} MiB int8, {w['int4'] / 2**20:.1f} MiB int4, "
              f"{w['bf16 copies'] / 2**20:.1f} MiB bf16 copies, "
              f"{w['other'] / 2**20:.1f} MiB scales/norms)")  # fmt: skip
    if omp:
        out["omp_options"] = omp_options(locations, ref)
        for name, r in out["omp_options"].items():
            print(f"OpenMP {name:<38} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in r.items()))  # fmt: skip
    return out
