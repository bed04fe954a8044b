"""What this CPU offers the kernel tests: PyTorch's CPU dispatch levels it can run (``ATEN_CPU_CAPABILITY``) and
whether its int8 GEMM (``torch._int_mm``) is exact."""

from __future__ import annotations

import platform

import torch

LEVELS = ("default", "avx2", "avx512")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def missing_reason(level: str) -> str | None:
    """Why this machine cannot run ``level`` (None if it can): torch's own requirements."""
    if level == "default":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"this CPU is not x86 ({platform.machine()}): no {level} dispatch level"
    flags = cpu_flags()
    if not flags:
        return f"no /proc/cpuinfo flags to tell whether this CPU has {level}"
    need = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}}[level]
    lacking = sorted(need - flags)
    return f"this CPU lacks {level} (ATEN_CPU_CAPABILITY={level}: no {', '.join(lacking)})" if lacking else None


def int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` gives the exact int32 product here. With VNNI / AMX-int8 it does; without
    (an AVX2-only CPU, or ATEN_CPU_CAPABILITY=avx2|default with ONEDNN_MAX_CPU_ISA capped) oneDNN's u8s8
    pairs saturate at int16: max error 28592 of 141136 measured on a 5x64 @ 64x96 product."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
