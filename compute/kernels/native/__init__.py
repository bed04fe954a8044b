"""pdserve's own CPU kernels: a C++ library built once per install for this machine, loaded by path.

Lifecycle:
 1. ``build()`` (``make venv`` runs ``python -m compute.kernels.native``, so `make demo` and `make test` have it)
    compiles ``int8_linear.cpp`` and ``lora.cpp`` against the installed torch with g++ into ``build/`` beside this file (staged
    in a temp file, renamed into place: never a half-written library). It names the source's sha256 and
    torch's version, so a changed source or torch is rebuilt, never loaded stale. No ``-march``: one library
    runs on any x86-64 CPU, its AVX2 / AVX-512 bodies chosen at run time (see the source's header);
 2. ``available()``: the library is loaded (``torch.ops.load_library``) at most once per process and its
    ISA level set from torch's dispatch level (``ATEN_CPU_CAPABILITY`` lowers ours alike). A process never
    compiles: where the library is missing or fails to load, ``available()`` is False and the kernel table
    leaves ``native`` out (one log line);
 3. ``int8_linear(x, q, scale)``: ``torch.ops.pdserve.int8_linear``, a registered op (torch.export traces
    it through its fake kernel below).

Trust: the library is built from the source shipped in this package, on the machine that runs it, at install
time, like any compiled dependency pip installs; nothing native comes from the parameter store.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading

import torch

log = logging.getLogger("pdserve.node")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, name) for name in ("int8_linear.cpp", "lora.cpp")]
INCLUDED = [os.path.join(HERE, "lora_body.inc")]  # part of the digest, compiled through lora.cpp
BUILD_DIR = os.path.join(HERE, "build")
ISA_LEVELS = {"default": 0, "avx2": 1, "avx512": 2}  # torch's dispatch level -> the library's body
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "why": str, "isa": int


class NativeBuildFailed(RuntimeError):
    """The compiler failed: the kernels run without ``native`` (install g++ and rebuild to get it)."""


def library_path() -> str:
    """Where this source, built against this torch, lives: a name per (source hash, torch version)."""
    h = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES + INCLUDED:
        with open(source, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:16]
    return os.path.join(BUILD_DIR, f"pdserve_native-{digest}.so")


def _command(out: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H", *SOURCES, "-o", out]  # fmt: skip
    cmd += [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    for p in library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return cmd + ["-lc10", "-ltorch_cpu"]


def build(force: bool = False) -> str:
    """Compile the library for this torch (seconds; nothing if it exists); -> its path."""
    path = library_path()
    if os.path.exists(path) and not force:
        return path
    os.makedirs(BUILD_DIR, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=BUILD_DIR, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(_command(tmp), capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise NativeBuildFailed(f"g++ failed ({done.returncode}): {done.stderr.strip()[-400:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in os.listdir(BUILD_DIR):  # libraries of an older source or torch
        if old.endswith(".so") and os.path.join(BUILD_DIR, old) != path:
            os.unlink(os.path.join(BUILD_DIR, old))
    return path


def available() -> bool:
    """Whether ``torch.ops.pdserve.int8_linear`` runs in this process (loads the built library once)."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
    return bool(_state["loaded"])


def _load() -> bool:
    if os.environ.get("PDSERVE_NATIVE", "1") == "0":  # the kernels without it (a comparison, a test)
        _state["why"] = "PDSERVE_NATIVE=0"
        return False
    try:
        path = library_path()
    except OSError as e:  # a source missing from the install: the kernels run without native
        _state["why"] = f"source missing ({e.filename}): reinstall pdserve"
        log.warning("native kernels unavailable: %s", _state["why"])
        return False
    if not os.path.exists(path):
        _state["why"] = f"not built ({path}): run `python -m compute.kernels.native`"
        log.warning("native kernels unavailable: %s", _state["why"])
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        _state["why"] = f"{type(e).__name__}: {e}"
        log.warning("native kernels unavailable: %s", _state["why"])
        return False
    _register_fake()
    wanted = ISA_LEVELS.get(torch.backends.cpu.get_cpu_capability().lower(), 0)
    _state["isa"] = int(torch.ops.pdserve.int8_isa(wanted))
    return True


def _register_fake() -> None:
    @torch.library.register_fake("pdserve::int8_linear")
    def _(x, q, scale):  # x: [M, K], q: [N, K] -> [M, N] fp32
        return x.new_empty((x.shape[0], q.shape[0]), dtype=torch.float32)


def isa() -> str:
    """The body in use: scalar | avx2 | avx512 ("" if not loaded)."""
    if not available():
        return ""
    return {v: k for k, v in ISA_LEVELS.items()}[int(_state["isa"])].replace("default", "scalar")


def why_unavailable() -> str:
    available()
    return str(_state.get("why", ""))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float @ (q: [N, K] int8 * scale: [N] fp32)^T -> [M, N] fp32 (fp32 sums: no activation rounding)."""
    return torch.ops.pdserve.int8_linear(x, q, scale)


def main(argv: list[str] | None = None) -> int:
    """``python -m compute.kernels.native [--force]``: build the library; one line either way."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = build(force="--force" in argv)
    except (NativeBuildFailed, OSError, subprocess.TimeoutExpired) as e:
        print(f"pdserve native kernels: not built: {e}", file=sys.stderr)
        return 1
    print(f"pdserve native kernels: {path}")
    return 0
