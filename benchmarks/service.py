"""`pdserve up` as the benchmarks run it: the real command in a process of its own, observed from outside.

Lifecycle of one ``UpService``:
 1. ``start``: a TOML config is written to a temporary folder — [gateway], [node] and [autoscaler]
    tables holding only the keys this tree's config dataclasses know (the others are listed in
    ``skipped``, so a report says what a run could not set) — and `pdserve up --config F --port P
    --prefill N --decode M [--model A --model B ...] [--autoscale]` is spawned in its own process
    group with a fresh internal token; its output goes to ``<log_dir>/up.log``;
 2. ``wait_ready``: the gateway's /ready answers 200 (bounded); ``wait_for`` polls any condition
    on the gateway's /internal/status snapshot (bounded);
 3. observation: ``status()`` (the gateway's snapshot: nodes with their last /load, the
    autoscaler's last report), ``load(url)`` (a node's /load, directly, for sub-second timing),
    ``node_pids()`` (the node processes among the service's descendants, by their --port) and
    ``memory()`` (their RSS and peak RSS from /proc, the peak kept for nodes that have exited);
 4. ``stop``: SIGTERM (the service drains and stops its nodes; they also end with it by their
    lifeline), SIGKILL to the group after ``stop_timeout_s``.

What a benchmark reads over time (the ``Sampler`` thread, the /load readers ``node_model_state`` and
friends, ``count_ready`` / ``count_standby``) lives in benchmarks/observe.py; it is re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx

from benchmarks.observe import (  # noqa: F401 - re-exported: burst.py, swap.py and the tests import them from here
    Sampler,
    count_ready,
    count_standby,
    node_active,
    node_model,
    node_model_state,
    node_state,
    status_nodes,
)
from compute.node.auth import SignedAuth
from compute.node.client import SyncNodeClient
from compute.node.launcher import free_port, service_env
from compute.node.lifeline import spawn_kwargs


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def known_fields() -> dict[str, set[str]]:
    """Config table -> the keys this tree's dataclass for it accepts."""
    from autoscaler.config import AutoscalerConfig
    from compute.node.config import NodeConfig
    from gateway.config import GatewayConfig

    return {t: {f.name for f in dataclasses.fields(c)}
            for t, c in (("autoscaler", AutoscalerConfig), ("gateway", GatewayConfig), ("node", NodeConfig))}  # fmt: skip


def write_config(path: str, tables: dict[str, dict]) -> list[str]:
    """Write the tables' known keys as TOML; -> the "table.key" entries left out (unknown to this tree)."""
    known, skipped, lines = known_fields(), [], []
    for table, kv in tables.items():
        lines.append(f"[{table}]")
        for k, v in kv.items():
            if v is None:
                continue
            if table in known and k not in known[table]:
                skipped.append(f"{table}.{k}")
                continue
            lines.append(f"{k} = {_toml_value(v)}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return skipped


class UpService:
    """One `pdserve up` process and what the benchmark reads from it."""

    def __init__(self, models: list[str], store: list[str], log_dir: str, tables: dict[str, dict],
                 plan: dict[str, int], autoscale: bool = True, stop_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.models, self.store, self.log_dir, self.plan = models, store, log_dir, plan
        self.env = dict(env or {})  # on top of this process's environment (e.g. a HOME of the benchmark's own)
        self.token = secrets.token_urlsafe(24)
        self.auth = SignedAuth(self.token)  # signs /internal/status and the nodes' /load
        self.admin_key = secrets.token_urlsafe(24)  # given to `pdserve up`: it writes no key file then
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_timeout_s = stop_timeout_s
        os.makedirs(log_dir, exist_ok=True)
        self.config_path = os.path.join(tempfile.mkdtemp(prefix="pdserve-bench-cfg-"), "pdserve.toml")
        self.skipped = write_config(self.config_path, tables)
        cmd = [sys.executable, "-m", "autoscaler.cli", "up", "--config", self.config_path, "--port", str(self.port),
               "--log-dir", os.path.join(log_dir, "nodes"), "--log-level", "warning"]  # fmt: skip
        for m in models:
            cmd += ["--model", m]
        for url in store:
            cmd += ["--store", url]
        for role, n in plan.items():
            cmd += [f"--{role}", str(n)]
        if autoscale:
            cmd.append("--autoscale")
        self.cmd = cmd
        self.p: subprocess.Popen | None = None
        self.started = 0.0
        self._client = httpx.Client(timeout=5.0, auth=self.auth)  # the gateway's own routes
        self._nodes = SyncNodeClient(None, timeout_s=5.0, auth=self.auth)
        self._peak: dict[int, dict] = {}  # pid -> last memory sample (kept after the node exits)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> UpService:
        self._log = open(os.path.join(self.log_dir, "up.log"), "wb")  # noqa: SIM115 - closed by stop()
        env = service_env(self.token, **{**self.env, "PDSERVE_ADMIN_KEY": self.admin_key})
        self.p = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                  **spawn_kwargs(env, pdeathsig=threading.current_thread() is threading.main_thread()))  # fmt: skip
        self.started = time.monotonic()
        return self

    def log_tail(self, n: int = 2000) -> str:
        with open(os.path.join(self.log_dir, "up.log"), "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Seconds from spawn until the gateway's /ready is 200."""
        return self.wait(lambda: self._get("/ready", raw=True) == 200, timeout_s, "the gateway /ready")

    def wait_for(self, pred, timeout_s: float, what: str) -> float:
        """Poll pred(status snapshot) every 0.25 s until true; -> seconds waited."""
        return self.wait(lambda: (s := self.status()) is not None and pred(s), timeout_s, what)

    def wait(self, cond, timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.p is not None and self.p.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.p.returncode}: {self.log_tail()}")
            if cond():
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError(f"{what}: not reached in {timeout_s:g} s; pdserve up log: {self.log_tail(1200)}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL to the group; -> its exit code."""
        self._client.close()
        self._nodes.close()
        if self.p is None:
            return None
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(10)
        self._log.close()
        return self.p.returncode

    # --- observation -------------------------------------------------------------------
    def _get(self, path: str, raw: bool = False, base: str | None = None):
        try:
            r = self._client.get((base or self.url) + path)
        except httpx.HTTPError:
            return None
        if raw:
            return r.status_code
        return r.json() if r.status_code == 200 else None

    def status(self) -> dict | None:
        return self._get("/internal/status")

    def load(self, node_url: str) -> dict | None:
        """A node's /load (``protocol.LoadReport``) as a dict; None if it does not answer."""
        try:
            return self._nodes.load(node_url).as_dict()
        except (httpx.HTTPError, ValueError):
            return None

    def node_pids(self) -> dict[str, int]:
        """Node url -> pid, for the node processes among this service's descendants."""
        return {url: pid for url, (pid, _) in self.nodes().items()}

    def processes(self) -> list[int]:
        """The `pdserve up` process and every process below it."""
        if self.p is None:
            return []
        out, todo, seen = [], [self.p.pid], set()
        children = _children_map()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def nodes(self) -> dict[str, tuple[int, str]]:
        """Node url -> (pid, role), for the node processes among this service's descendants."""
        out = {}
        for pid in self.processes():
            argv = _cmdline(pid)
            if "node" in argv and "--port" in argv:
                i, j = argv.index("--port"), argv.index("--role") if "--role" in argv else -1
                if i + 1 < len(argv):
                    role = argv[j + 1] if 0 <= j < len(argv) - 1 else "?"
                    out[f"http://127.0.0.1:{argv[i + 1]}"] = (pid, role)
        return out

    def memory(self) -> dict[str, dict]:
        """"url#pid" -> {"url", "pid", "rss_bytes", "peak_rss_bytes", "first_rss_bytes" (at its first sample)}
        now; nodes that have exited keep their last sample."""
        for url, pid in self.node_pids().items():
            m = proc_status(pid)
            if m:
                first = self._peak.get(pid, {}).get("first_rss_bytes", m["rss_bytes"])
                self._peak[pid] = {"url": url, "pid": pid, "first_rss_bytes": first, "rss_bytes": m["rss_bytes"],
                                   "peak_rss_bytes": m["peak_rss_bytes"]}  # fmt: skip
        return {f"{v['url']}#{pid}": v for pid, v in self._peak.items()}


# --- /proc -------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(d))
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def proc_status(pid: int) -> dict | None:
    """{"rss_bytes", "peak_rss_bytes", "threads"} from /proc/PID/status (VmRSS, VmHWM, Threads), None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kb = lambda k: int(fields[k].split()[0]) * 1024
        return {"rss_bytes": kb("VmRSS"), "peak_rss_bytes": kb("VmHWM"), "threads": int(fields["Threads"])}
    except (OSError, KeyError, ValueError):
        return None


def _models(load: dict | None) -> dict:
    """A node's /load as {model: its entry} ({} if it did not answer)."""
    ms = (load or {}).get("models") or {}
    return ms if isinstance(ms, dict) else {m.get("model"): m for m in ms}


class ServedEngine:
    """``pdserve up`` with one ``both`` node, streamed through the ``openai`` client (token-id prompts): the
    served column of `pdserve bench engine` (decode rate between streamed tokens, time to first token)."""

    batched = False

    def __init__(self, locations: list[str], model: str, threads: int, step: str = "eager") -> None:
        self.model, self.step, self.log_dir = model, step, tempfile.mkdtemp(prefix="pdserve-bench-engine-")
        self.up = UpService([model], locations, self.log_dir, {"node": {"threads": threads, "step": step}},
                            {"both": 1, "prefill": 0, "decode": 0}, autoscale=False)  # fmt: skip

    def start(self) -> ServedEngine:
        import openai

        self.up.start()
        try:
            self.up.wait_ready()
        except BaseException:
            self.up.stop()
            raise
        self.client = openai.OpenAI(base_url=f"{self.up.url}/v1", api_key=self.up.token, max_retries=0)
        if self.step == "graph":
            self._wait_graphs(1800)
        return self

    def _wait_graphs(self, timeout: float) -> None:
        """Until the node has taken its step graphs (from this machine or the store in seconds; built: minutes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            models = [_models(self.up.load(url)) for url in self.up.nodes()]
            graphs = [m[self.model].get("graphs") for m in models if self.model in m]  # not the pool's standby
            if graphs and all(g and g.get("idle") for g in graphs):
                print(f"served step graphs: {graphs}", file=sys.stderr, flush=True)
                return
            time.sleep(0.5)
        self.up.stop()
        raise TimeoutError(f"the served node's step graphs were not taken in {timeout:g} s")

    def stop(self) -> None:
        self.up.stop()

    def _run(self, prompt, tokens: int, fresh: bool = False) -> tuple[list[float], int]:
        """Stream one completion -> (the request's start and each text chunk's arrival, tokens generated).
        ``fresh``: under a new ``cache_salt``, so no cached prefix of an earlier call serves it (the node's prefix
        cache outlives a request; the in-process systems' does not). A chunk may carry several tokens (the text of
        a token that ends inside a UTF-8 character waits for the next), so tokens are counted by the usage."""
        body = {"ignore_eos": True} | ({"cache_salt": uuid.uuid4().hex} if fresh else {})
        stamps, used = [time.perf_counter()], 0
        stream = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=body)  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return stamps, used

    def decode_rate(self, prompt, tokens: int) -> float:
        """Tokens after the first one over the time from the first text chunk to the last."""
        s, used = self._run(prompt, tokens)
        return (used - 1) / (s[-1] - s[1])

    def prefill_time(self, prompt) -> float:
        s, _ = self._run(prompt, 1, fresh=True)
        return s[1] - s[0]
