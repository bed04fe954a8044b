"""The step-graph builder process: one package compiled outside the serving process, killed as a group.

Lifecycle (``GraphBuilder`` in ``compute.node.graph_builder`` runs ``build``, under its per-machine lock):
 1. ``build`` starts ``python -m compute.node.graph_process`` in a process group of its own (in the node's session:
    the same scheduler autogroup, so its SCHED_IDLE holds against the serving threads) and writes
    the request on its stdin as JSON: the graph's spec (``step_graphs.spec``: kernel per linear, every bound
    tensor's name, shape and dtype, aliases, dims), the batch range, torch's threads, the output path;
 2. the child runs SCHED_IDLE (``yield_cpu``; the compiler processes it starts inherit it), asks the kernel to SIGTERM it if
    its parent dies (it then kills its whole group), builds a ``GraphStep`` skeleton of random tensors with those
    shapes (``GraphStep.skeleton``: a package holds no weights, the node binds its own at load, and what inductor
    folds from them is folded at load) — traces and compiles it with AOTInductor
    (``export_package``) into the output path, and exits 0; on failure it writes one line on stderr and exits 1;
 3. ``build`` polls it: a stop (the node closing, a plan swap) or the time limit SIGKILLs the group — the child and
    every compiler below it — and raises ``BuildStopped``. Serving threads share no interpreter (no GIL) with the
    trace, and nothing the build started outlives the node;
 4. the partial file of a build whose process was killed (``partial_path``: the builder's pid in its name) is
    removed by the next build in that folder (``sweep``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch

from compute.kernels.artefacts import yield_cpu
from compute.modeling.graph_step import GraphStep, step_inputs

BUILD_LIMIT_S = 1800.0  # one package's build, at most (SmolLM2 on 2 niced cores: ~1 min)
KV_BLOCKS = 8  # the traced cache's blocks (zeros: an input, never folded) (the package takes any number: the dimension is dynamic)
PR_SET_PDEATHSIG = 1


class BuildStopped(RuntimeError):
    """The build was cut short by a stop or its time limit: nothing was written; take the graphs again later."""


def build(spec: dict, lo: int, hi: int, out: str, stop: threading.Event, limit_s: float = BUILD_LIMIT_S,
          on_start=None) -> None:  # fmt: skip
    """Compile the package of ``spec`` for batches ``lo..hi`` into ``out`` in a child process group (module doc).
    ``on_start(popen)`` gets the child once started (for a caller that kills it from another thread)."""
    request = json.dumps({"spec": spec, "lo": lo, "hi": hi, "out": out, "threads": torch.get_num_threads()})
    with tempfile.TemporaryFile() as err:
        # a process group of its own (killed as one), in the node's session: a new session is a new scheduler
        # autogroup (sched_autogroup_enabled), weighted as much as the node's whatever its policy, and the build
        # then took half the CPU from serving (a decode step's OpenMP barriers made that 20 -> 1-2 tok/s)
        child = subprocess.Popen([sys.executable, "-m", "compute.node.graph_process"], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=err, process_group=0)  # fmt: skip
        if on_start is not None:
            on_start(child)
        try:
            child.stdin.write(request.encode())
            child.stdin.close()
            deadline = time.monotonic() + limit_s
            while child.poll() is None:
                if stop.wait(0.1) or time.monotonic() > deadline:
                    why = "stopped" if stop.is_set() else f"over its {limit_s:.0f} s limit"
                    raise BuildStopped(f"step graph build {why}: its process group killed")
        except BaseException:
            kill(child)
            raise
        if child.returncode != 0:
            err.seek(0)
            lines = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
            raise RuntimeError(f"step graph build failed (exit {child.returncode}): {lines[-1] if lines else '?'}")


def kill(child: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it and every compiler it started) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(10)


def partial_path(folder: str, gid: str) -> str:
    """Where this process writes package ``gid`` before it is renamed into place (``sweep`` reads the pid back)."""
    return os.path.join(folder, f".{gid}.{os.getpid()}.building.pt2")


def sweep(folder: str) -> None:
    """Remove the partial files of builds whose process is gone (killed mid-build)."""
    for name in os.listdir(folder):
        parts = name.split(".")
        if name.startswith(".") and name.endswith(".building.pt2") and len(parts) == 5 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            except PermissionError:  # another user's live process
                pass


def export_package(step, lo: int, hi: int, cache, keys: int, path: str) -> str:
    """Trace ``step`` for batches lo..hi, any number of keys (a multiple of the block size, 2..keys) and any cache
    size, and compile it with AOTInductor into ``path`` without its weights (bound at load)."""
    from torch.export import Dim

    bs = cache.block_size
    b = lo if lo == hi else max(lo, 2)
    n = max(2 * bs, 32) if keys >= max(2 * bs, 32) else keys
    blocks = cache.num_blocks
    tables = [[(j * (n // bs) + i) % blocks for i in range(n // bs)] for j in range(b)]
    ids, pos, _, ctx_slots, ctx_lens = step_inputs([1] * b, [n - 1] * b, tables, bs, n)
    B = None if lo == hi else Dim("B", min=lo, max=hi)
    L = Dim("L", min=2, max=keys)
    NB = Dim("NB", min=2, max=2**31 - 1)
    dyn = ({0: B} if B else None, {0: B} if B else None, {0: B, 1: L} if B else {1: L}, {0: B} if B else None,
           {2: NB})  # fmt: skip
    with torch.no_grad():
        ep = torch.export.export(step, (ids, pos, ctx_slots, ctx_lens, cache.kv), dynamic_shapes=dyn, strict=False)
        return torch._inductor.aoti_compile_and_package(
            ep, package_path=path, inductor_configs={"aot_inductor.package_constants_in_so": False,
                                            "aot_inductor.use_runtime_constant_folding": True})


def _die_with_parent() -> None:
    """SIGTERM when the parent dies (Linux), and on SIGTERM kill this whole group: no compiler outlives the node."""
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the request was read
        os.killpg(0, signal.SIGKILL)


def main() -> int:
    _die_with_parent()
    yield_cpu()  # SCHED_IDLE: the compilers it starts inherit it
    try:
        req = json.loads(sys.stdin.read())
        torch.set_num_threads(int(req["threads"]))
        from compute.kernels import native

        native.available()  # a graph that runs the native kernel traces its registered op

        sp, lo, hi = req["spec"], int(req["lo"]), int(req["hi"])
        nl, _, kvh, dh = sp["dims"][:4]
        dtype = getattr(torch, sp["kv_dtype"].removeprefix("torch."))
        bs = int(sp["block_size"])
        cache = SimpleNamespace(block_size=bs, num_blocks=KV_BLOCKS, kv=torch.zeros(nl, 2, KV_BLOCKS, bs, kvh, dh,
                                                                                     dtype=dtype))  # fmt: skip
        export_package(GraphStep.skeleton(sp), lo, hi, cache, int(sp["max_keys"]), req["out"])
    except Exception as e:  # noqa: BLE001 - one line for the node's log
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
