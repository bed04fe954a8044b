"""The int8 kernels under every CPU dispatch level this machine offers, each in a subprocess.

PyTorch picks its CPU kernels once per process from ``ATEN_CPU_CAPABILITY``
(``default | avx2 | avx512``, read at import), so one machine runs the code paths of every
level its CPU has: an AVX-512 box also checks what an AVX2 box runs, and an AVX2 box what a
plain x86 one runs. oneDNN (bf16 / fp32 ``F.linear``) dispatches on its own; the subprocess
caps it to the same level with ``ONEDNN_MAX_CPU_ISA``. A level the CPU lacks is skipped
with the reason; one that torch does not honour fails.

Numerics: each result is compared with an fp64 reference of the same dequantized weight,
and the allowed error comes from a control measured in the same process on the same
inputs: bf16 ``F.linear`` (x and w rounded to bf16, bf16 out). ``int8mm`` rounds x, the
scales and y to bf16, the same order of error, so it must stay within ``MARGIN`` times the
control; the dequant path (fp32) lands far below. A broken kernel (NaN, garbage in a K
tail, wrong rows) misses by orders of magnitude. Each case prints a line before it starts,
so a segfault names the case that caused it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import pytest

from tests.compute.kernels import cpu
from tests.compute.kernels.cpu import LEVELS, missing_reason

MARGIN = 4.0  # allowed error / control error (see the docstring); a broken kernel is >> 100x off
CONTROL_MAX = 8 * 2**-8  # a sane control: a few bf16 unit roundoffs (2^-8) of relative error
ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2", "avx512": "ALL"}  # oneDNN's cap per level (ALL: the CPU's)
CASES = ("matmul_int8", "fused_int8", "embedding_int8", "misaligned_weight", "misaligned_input", "k_tail")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# --- the worker: runs in the subprocess ---------------------------------------------------------


def _worker(first: int) -> None:
    """Run CASES[first:], one JSON line before and after each."""
    import torch
    import torch.nn.functional as F

    from compute.kernels.linear import ALIGN, INT8MM_MAX_M, Embedding, FusedLinear, aligned, matmul
    from paramstore.quant import dequantize_int8, quantize_int8

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability()}), flush=True)

    def weight(n, k):
        q, s = quantize_int8(torch.randn(n, k, generator=g, dtype=torch.float64).float() * 0.05)
        return q, s

    def rel(y, ref):
        return ((y.double() - ref).norm() / ref.norm()).item()

    def check(x, q, s, run) -> dict:
        """err of run(x) and of the bf16 control, both against fp64 x @ dequant(q, s)^T."""
        w = dequantize_int8(q, s)
        ref = x.double() @ w.double().T
        control = rel(F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)), ref)
        err = rel(run(x), ref)
        return {"err": err, "control": control, "ok": err <= MARGIN * control and control <= CONTROL_MAX}

    def lin(q, s):
        return lambda x: matmul(x, q, s, s.to(torch.bfloat16), None, INT8MM_MAX_M)

    def at(t, offset):
        """A copy of t at ``offset`` bytes past a 64-byte boundary (a view into a larger buffer)."""
        es = t.element_size()
        buf = torch.empty(t.numel() + 2 * ALIGN // es, dtype=t.dtype)
        start = ((-buf.data_ptr()) % ALIGN + offset) // es
        v = buf[start : start + t.numel()].view(t.shape)
        v.copy_(t)
        assert v.data_ptr() % ALIGN == offset % ALIGN
        return v

    ms = (1, 4, 32, INT8MM_MAX_M, INT8MM_MAX_M + 1, 130)  # int8mm up to INT8MM_MAX_M, dequant path above

    def matmul_int8():
        out = {}
        for n, k in ((160, 576), (96, 1536)):  # SmolLM2's K, fewer rows (the default level is slow)
            q, s = weight(n, k)
            for m in ms:
                out[f"{n}x{k} M={m}"] = check(torch.randn(m, k, generator=g), q, s, lin(q, s))
        return out

    def fused_int8():
        out = {}
        qs = [weight(n, 576) for n in (96, 32, 32)]  # q/k/v-shaped rows
        fused = FusedLinear(576, (96, 32, 32))
        for part, (q, s) in zip(fused.parts, qs):
            part.load("weight", q)
            part.load("weight_scale", s)
        q, s = torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])
        for m in ms:
            out[f"M={m}"] = check(torch.randn(m, 576, generator=g), q, s, fused)
        return out

    def embedding_int8():
        q, s = weight(1000, 576)
        ids = torch.randint(0, 1000, (37,), generator=g)
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            emb = Embedding(1000, 576, dtype)
            emb.load("weight", q)
            emb.load("weight_scale", s)
            want = dequantize_int8(q, s)[ids].to(dtype)
            out[str(dtype)] = {"ok": bool(torch.equal(emb(ids), want))}
        return out

    def misaligned_weight():
        """Weights viewed at the offsets that faulted on AVX-512, through ``aligned`` (load's path)."""
        out = {}
        q, s = weight(256, 576)
        for off in (8, 40, 16, 0):
            view = at(q, off)
            a = aligned(view)
            for m in (1, 4, 32):
                x = torch.randn(m, 576, generator=g)
                r = check(x, q, s, lin(a, s))
                r["aligned"] = a.data_ptr() % ALIGN == 0 and (a is view) == (off == 0)  # copied iff misaligned
                r["equal"] = bool(torch.equal(lin(a, s)(x), lin(q, s)(x)))  # the same numbers as aligned
                r["ok"] = r["ok"] and r["aligned"] and r["equal"]
                out[f"offset {off} M={m}"] = r
        return out

    def misaligned_input():
        """bf16 activations viewed off a 64-byte boundary, straight into ``matmul``."""
        out = {}
        q, s = weight(256, 576)
        for off in (2, 8, 16, 48):
            for m in (2, 4, 32):
                x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
                xv = at(x, off)
                r = check(xv, q, s, lin(q, s))
                r["equal"] = bool(torch.equal(lin(q, s)(xv), lin(q, s)(x)))
                r["ok"] = r["ok"] and r["equal"]
                out[f"offset {off} M={m}"] = r
        return out

    def k_tail():
        """K not a multiple of 16 (AVX-512 int8mm: NaN at M = 1, SIGSEGV at M >= 4): the dequant path."""
        out = {}
        for k in (40, 72, 100, 48):
            q, s = weight(64, k)
            for m in (1, 4, 32):
                out[f"K={k} M={m}"] = check(torch.randn(m, k, generator=g), q, s, lin(q, s))
        return out

    cases = {"matmul_int8": matmul_int8, "fused_int8": fused_int8, "embedding_int8": embedding_int8,
             "misaligned_weight": misaligned_weight, "misaligned_input": misaligned_input, "k_tail": k_tail}  # fmt: skip
    assert tuple(cases) == CASES
    for name, case in list(cases.items())[first:]:
        print(json.dumps({"start": name}), flush=True)
        t0 = time.perf_counter()
        results = case()
        ok = all(r["ok"] for r in results.values())
        worst = max((r["err"] / r["control"] for r in results.values() if "err" in r), default=0.0)
        print(json.dumps({"case": name, "ok": ok, "worst_ratio": worst, "seconds": time.perf_counter() - t0,
                          "results": results}), flush=True)  # fmt: skip


# --- the tests ---------------------------------------------------------------------------------

_runs: dict[str, dict] = {}


def run_level(level: str) -> dict:
    """The cases under ``level`` (cached): its capability, case records, crashes, stderr.

    One worker process runs every case; one that dies (SIGSEGV) is restarted after the case
    it died in, so each later case still gets its own verdict (at most len(CASES) starts)."""
    if level in _runs:
        return _runs[level]
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, ONEDNN_MAX_CPU_ISA=ONEDNN_ISA[level],
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2")  # fmt: skip
    run = {"capability": None, "cases": {}, "crashed": {}, "stderr": ""}
    first = 0
    while first < len(CASES):
        p = subprocess.run([sys.executable, "-m", "tests.compute.kernels.test_dispatch", "--worker", str(first)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        run["stderr"] += p.stderr[-2000:]
        last = None
        for line in p.stdout.splitlines():
            rec = json.loads(line)
            if "capability" in rec:
                run["capability"] = rec["capability"]
            elif "start" in rec:
                last = rec["start"]
            else:
                run["cases"][rec["case"]] = rec
        if last is None or last in run["cases"]:  # it died before the cases, or after the last one
            if p.returncode != 0:
                run["crashed"].update(dict.fromkeys(CASES[first:], f"rc {p.returncode} outside any case"))
            break
        run["crashed"][last] = f"rc {p.returncode}"
        first = CASES.index(last) + 1
    _runs[level] = run
    return run


@pytest.fixture(params=LEVELS)
def level(request):
    reason = missing_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def test_torch_runs_the_requested_level(level):
    run = run_level(level)
    assert run["capability"] == level.upper(), (run["capability"], run["stderr"])


@pytest.mark.parametrize("case", CASES)
def test_int8_kernels_match_fp64_within_the_bf16_control(level, case):
    run = run_level(level)
    if case in run["crashed"]:
        pytest.fail(f"ATEN_CPU_CAPABILITY={level}: the process died in case {case!r} ({run['crashed'][case]})\n"
                    f"{run['stderr'][-2000:]}")  # fmt: skip
    rec = run["cases"][case]
    bad = {k: r for k, r in rec["results"].items() if not r["ok"]}
    print(f"{level} {case}: worst error {rec['worst_ratio']:.2f}x the bf16 control, {rec['seconds']:.2f} s")
    assert not bad, f"ATEN_CPU_CAPABILITY={level} {case}: beyond {MARGIN}x the bf16 control (or unequal): {bad}"


def test_a_level_the_cpu_lacks_is_an_optional_skip_naming_the_flags(monkeypatch):
    from tests.required import required

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    assert missing_reason("default") is None and missing_reason("avx2") is None
    reason = missing_reason("avx512")
    assert reason.startswith("this CPU lacks avx512") and "avx512bw" in reason and "avx512f" in reason
    assert required(reason) is None  # truly optional: never a CI failure under PDSERVE_REQUIRE_ALL


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]))
