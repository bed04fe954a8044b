"""The systems `pdserve bench served` runs, each a real server on 127.0.0.1 in a process group of its own, started
one at a time and stopped (SIGTERM, a bounded wait, SIGKILL to the group) on every exit path: ``LlamaServer``
(llama.cpp's `llama-server` on a GGUF; ``q8_twin`` makes its Q8_0 twin) and ``PdServe`` (`pdserve up`, waited on
until its first start's background work has settled)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

KEEPALIVE_S = 60.0  # while settling, one short request this often: a model idle 300 s is scaled to zero (a default)
SLOTS = 16


def _pdeathsig() -> None:
    """In the child, before exec: SIGTERM when the benchmark dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _stop_group(p: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM the process, wait at most timeout_s, then SIGKILL its whole group; -> its exit code."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: anything it left behind goes too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass
    return p.returncode


class LlamaServer:
    """One `llama-server` process on a GGUF."""

    def __init__(self, binary: str, gguf: str, tokens: int, threads: int, log_dir: str) -> None:
        from compute.node.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.per_slot = _per_slot(tokens)
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(SLOTS),
                    "-c", str(SLOTS * self.per_slot), "--threads", str(threads), "--cont-batching", "--no-webui"]  # fmt: skip
        self.log_path = os.path.join(log_dir, f"llama-server-{self.port}.log")
        self.p: subprocess.Popen | None = None

    def start(self) -> LlamaServer:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        main = threading.current_thread() is threading.main_thread()
        self.p = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=_pdeathsig if main else None)  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.p.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.p.returncode}: {_tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"llama-server not healthy in {timeout_s:g} s: {_tail(self.log_path)}")

    def settle(self, timeout_s: float) -> dict:
        return {}

    def stop(self) -> int | None:
        if self.p is None:
            return None
        rc = _stop_group(self.p, 15.0)
        self._log.close()
        return rc


class PdServe:
    """`pdserve up --model NAME --port P`, defaults otherwise (benchmarks/service.py: its own process group);
    ``split``: `--prefill 1 --decode 1` (one thread each, the split's default)."""

    def __init__(self, model: str, locations: list[str], home: str, log_dir: str, split: bool = False) -> None:
        from benchmarks.service import UpService

        self.model = model
        env = {"HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache")}
        plan = {"prefill": 1, "decode": 1} if split else {}
        self.up = UpService([model], locations, log_dir, {}, plan, autoscale=False, stop_timeout_s=60.0, env=env)
        self.url, self.cmd = self.up.url, self.up.cmd

    def start(self) -> PdServe:
        self.up.start()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        return self.up.wait_ready(timeout_s)

    def nodes_state(self) -> dict[str, dict]:
        """Node url -> {"state": the model's state there, "kernels": its /load kernels entry (mode, source,
        measure), "graphs": its compiled decode steps (None where the node runs eager steps)}, for the nodes that
        hold the model."""
        out = {}
        for url in self.up.nodes():
            entry = ((self.up.load(url) or {}).get("models") or {}).get(self.model)
            if entry:
                out[url] = {k: entry.get(k) for k in ("state", "kernels", "graphs")}
        return out

    @staticmethod
    def _settled(n: dict) -> bool:
        measuring = (n["kernels"] or {}).get("measure") in ("waiting", "measuring")
        building = n["graphs"] is not None and not n["graphs"].get("idle")
        return n["state"] == "ready" and not measuring and not building

    def settle(self, timeout_s: float) -> dict:
        """Until the model is ready on every node that holds it, none measures its kernel plan (a first start on an
        empty HOME does, in the background, after ready) and none builds compiled decode steps (``step`` graph, or
        auto on the CPU: built in the background after ready, once per machine class)."""
        t0, last, poked = time.monotonic(), {}, time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            import httpx

            if time.monotonic() - poked > KEEPALIVE_S:  # a user of the service, not an idle model to scale to zero
                poked = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(self.url + "/v1/completions", json={"model": self.model, "prompt": "Hi", "max_tokens": 1},
                               timeout=30.0)  # fmt: skip
            last = self.nodes_state()
            if last and all(self._settled(n) for n in last.values()):
                return {"nodes": last, "settle_s": round(time.monotonic() - t0, 1)}
            if self.up.p is not None and self.up.p.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.up.p.returncode}: {self.up.log_tail()}")
            time.sleep(1.0)
        raise TimeoutError(f"pdserve's kernel plan or step graphs not settled after {timeout_s:g} s: {last}")

    def stop(self) -> int | None:
        return self.up.stop()


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]
    except OSError:
        return ""


def _per_slot(tokens: int) -> int:
    """Context per llama-server slot: the chat template's default system prompt + a short prompt (~60 tokens) +
    the output, with room to spare, rounded up to 64."""
    need = 128 + tokens + 32
    return max(256, -(-need // 64) * 64)


# --- the GGUFs ---------------------------------------------------------------------------------------------
def q8_twin(llama_server: str, src: str, dst: str | None) -> str:
    """The Q8_0 twin of ``src``: made once with llama-quantize (beside llama-server), cached at ``dst``."""
    if dst is None:
        stem = os.path.basename(src).removesuffix(".gguf")
        stem = stem.rsplit(".", 1)[0] if stem.rsplit(".", 1)[-1].upper().startswith("Q") else stem
        dst = os.path.join(".pdserve", "gguf", f"{stem}.Q8_0.gguf")
    if os.path.exists(dst):
        return dst
    quantize = os.path.join(os.path.dirname(llama_server), "llama-quantize")
    if not os.access(quantize, os.X_OK):
        raise ValueError(f"no {quantize} to make the Q8_0 twin: make llama-server")
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = f"{dst}.tmp-{os.getpid()}"
    print(f"making the Q8_0 twin {dst} (once) ...", file=sys.stderr, flush=True)
    try:
        out = subprocess.run([quantize, "--allow-requantize", src, tmp, "Q8_0"], capture_output=True, text=True,
                             timeout=600, check=False)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({out.returncode}): {(out.stdout + out.stderr)[-800:]}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


# --- the workload ------------------------------------------------------------------------------------------
