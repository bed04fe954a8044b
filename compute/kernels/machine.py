"""This machine as its kernels see it: the key that names a class of machines (CPU model, the ISA flags that decide
kernel speed, torch's dispatch level, the native kernels' body, torch version, threads). Kernel tables and step-graph
packages are valid only for their key (``compute.kernels.int8``, ``compute.kernels.plans``,
``compute.node.graph_builder``)."""

from __future__ import annotations

import hashlib
import platform

import torch

from compute.kernels import native

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_bf16", "amx_int8", "amx_tile")  # fmt: skip


def cpu() -> tuple[str, set[str]]:
    """(CPU model name, this CPU's ``ISA_FLAGS``) from /proc/cpuinfo (the platform's name and no flags elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags & set(ISA_FLAGS)


def machine() -> str:
    """This CPU as its kernels see it: model name, the ISA flags that decide kernel speed, the level torch
    dispatches at (``ATEN_CPU_CAPABILITY`` can lower it below what the flags allow), and the native kernels' body
    (none where they are not built: a plan naming them is then another machine class's, never run here; asking
    loads the library, so a plan from the store or the cache that names them finds their op registered)."""
    model, flags = cpu()
    have = " ".join(f for f in ISA_FLAGS if f in flags)
    return f"{model}|{have}|dispatch {torch.backends.cpu.get_cpu_capability()}|native {native.isa() or 'none'}"


def machine_key(threads: int) -> str:
    """``machine()`` + torch version + threads: a table is valid only where all of them match."""
    raw = f"{machine()}|torch {torch.__version__}|{threads} threads"
    return f"{hashlib.sha256(raw.encode()).hexdigest()[:16]} {raw}"
