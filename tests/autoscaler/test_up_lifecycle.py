"""`pdserve up` stopped the ways a user, systemd, a container runtime or Kubernetes stop it, and a
node killed under it (real processes, the real model, the real `openai` client, /proc for pids):

- kill -9 of the decode runtime that holds the model: the warm pool places the model on the standby
  decode runtime, the actuator restarts the killed one in its slot (standby), the service answers a
  chat request again without a human, and `pdserve status` shows the restart and how it ended;
- SIGTERM while a stream is in flight: the stream completes, `pdserve up` exits 0 with one line
  saying what it stopped, and no process it ever started (the replaced node too) is left;
- SIGINT while its nodes are still starting: it exits 0, none left;
- a node that cannot start (a bad [node] setting in the config file) crash-loops, backing off, and
  `pdserve status` shows the loop with the node's own error line; SIGTERM still stops everything;
- SIGKILL: nothing in it can clean up, yet its nodes end within seconds (compute/node/lifeline.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from compute.node.launcher import Services
from tests.procs import alive, children, kill_left, wait_gone
from tests.services import TOKEN, admin_headers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
openai = pytest.importorskip("openai")
MODEL = "smollm2"  # the name real_model_store imports the real model under
Q = [{"role": "user", "content": "What is the capital of France?"}]
LIFELINE_GRACE_S = 10.0  # compute/node/lifeline.hold's default: a node's bound on exiting after its parent


class Up:
    """One `pdserve up` (its own log dir), with every node pid it was seen to start."""

    def __init__(self, tmp, store: list[str], model: str, *args: str):
        os.makedirs(tmp / "logs", exist_ok=True)
        self.svc = Services(store, model, str(tmp), TOKEN)
        self.proc = self.svc.start("up", ["up", "--log-dir", str(tmp / "logs"), *args])
        self.url, self.seen = self.proc.url, {}

    def nodes(self) -> dict[int, str]:
        kids = children(self.proc.p.pid)
        self.seen.update(kids)
        return kids

    def status(self) -> dict:
        return httpx.get(self.url + "/admin/status", headers=admin_headers(self.url), timeout=10).json()

    def wait_nodes(self, n: int, timeout: float) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while len(self.nodes()) < n:
            assert self.proc.p.poll() is None, self.proc.log()[-2000:]
            assert time.monotonic() < deadline, f"fewer than {n} nodes after {timeout:g} s"
            time.sleep(0.05)
        return self.nodes()

    def close(self) -> None:
        """Whatever state it is in: SIGTERM (SIGKILL after 10 s), then any node it left is killed."""
        try:
            self.proc.stop()
        finally:
            kill_left(self.seen)


def chat(url: str, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return c.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, temperature=0, **kw)


@pytest.fixture(scope="module")
def up(tmp_path_factory, real_model_store):
    """`pdserve up` with 1 prefill + 1 decode node, ready."""
    locations, name = real_model_store
    u = Up(tmp_path_factory.mktemp("up"), list(locations), name, "--prefill", "1", "--decode", "1")
    try:
        u.proc.wait_ready(timeout=180)
        u.wait_nodes(2, 10)
        yield u
    finally:
        u.close()


def holder(status: dict, role: str) -> dict:
    """The supervised slot of the `role` runtime that holds the model (the pool places it on one)."""
    (url,) = [r["url"] for r in status["supervisor"]["pool"]["runtimes"]
              if r["role"] == role and r["models"].get(MODEL) in ("loading", "ready")]  # fmt: skip
    (slot,) = [n for n in status["supervisor"]["nodes"] if n["url"] == url]
    return slot


def test_kill9_of_the_decode_node_is_replaced_without_a_human(up):
    assert "Paris" in chat(up.url).choices[0].message.content
    old = holder(up.status(), "decode")
    assert old["pid"] in up.nodes() and old["restarts"] == 0
    os.kill(old["pid"], signal.SIGKILL)
    t0, answer, failures = time.monotonic(), None, 0
    while answer is None:  # bounded: the restart waits 1 s, then loads the model (seconds)
        assert time.monotonic() - t0 < 120, f"no answer 120 s after the decode node was killed: {up.proc.log()[-3000:]}"
        try:
            answer = chat(up.url).choices[0].message.content
        except openai.APIError:
            failures += 1
            time.sleep(0.25)
    assert "Paris" in answer  # (the gateway may hold the request until a decode node is back: failures 0)
    print(f"answered again {time.monotonic() - t0:.1f} s after kill -9 of the decode node ({failures} failed tries)")
    st = wait_for(lambda: (s := up.status()) and [n for n in s["supervisor"]["nodes"]
                                                  if n["slot"] == old["slot"] and n["pid"]] and s,
                  60, "the killed slot restarted")  # fmt: skip
    (new,) = [n for n in st["supervisor"]["nodes"] if n["slot"] == old["slot"]]
    assert (new["restarts"], new["last_exit"]) == (1, "killed by SIGKILL")
    assert new["pid"] != old["pid"] and new["pid"] in up.nodes() and old["pid"] not in alive(up.seen)
    assert holder(st, "decode")["pid"] in up.nodes()  # the model is held again (the standby runtime claimed)
    out = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", up.url], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith(old["slot"] + " ")]
    assert str(new["pid"]) in line and "killed by SIGKILL" in line, out.stdout


def test_sigterm_finishes_the_open_stream_then_stops_every_process(up):
    up.nodes()
    c = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first, got = threading.Event(), {"text": "", "finish": None, "error": None}

    def stream():
        try:
            for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                                max_tokens=48, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}):  # fmt: skip
                if ch.choices and ch.choices[0].delta.content:
                    got["text"] += ch.choices[0].delta.content
                    first.set()
                if ch.choices and ch.choices[0].finish_reason:
                    got["finish"] = ch.choices[0].finish_reason
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            got["error"] = repr(e)
        finally:
            first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(60), "no first token"
    up.proc.p.send_signal(signal.SIGTERM)
    t.join(60)
    assert got["error"] is None and got["finish"] == "length", got  # the open stream was finished, in full
    assert up.proc.p.wait(60) == 0
    assert not alive(up.seen), f"left running: {alive(up.seen)}"
    (line,) = [ln for ln in up.proc.log().splitlines() if ln.startswith("pdserve up: stopped")]
    assert re.match(r"pdserve up: stopped on SIGTERM: the gateway and \d+ node\(s\) \(prefill pid ", line), line
    assert int(line.split(" and ")[1].split()[0]) >= 2, line  # the plan's runtimes, and the pool's standby ones


def test_sigint_while_nodes_start_stops_them_all(tmp_path, real_model_store):
    locations, name = real_model_store
    u = Up(tmp_path, list(locations), name)
    try:
        u.proc.wait_ready(timeout=60, path="/health")  # the gateway serves; its nodes are loading
        nodes = u.wait_nodes(2, 10)
        u.proc.p.send_signal(signal.SIGINT)
        assert u.proc.p.wait(60) == 0
        assert not alive(nodes), f"left running: {alive(nodes)}"
        assert re.search(r"pdserve up: stopped on SIGINT: the gateway and \d+ node\(s\)", u.proc.log())
    finally:
        u.close()


def test_sigkill_of_pdserve_up_ends_its_nodes_within_seconds(tmp_path, real_model_store):
    locations, name = real_model_store
    u = Up(tmp_path, list(locations), name, "--both", "1")
    try:
        u.proc.wait_ready(timeout=180)
        nodes = u.wait_nodes(1, 10)
        u.proc.p.kill()
        u.proc.p.wait(10)
        took = wait_gone(nodes, LIFELINE_GRACE_S + 10)  # SIGTERM at once; os._exit after the grace
        print(f"node gone {took:.2f} s after SIGKILL of pdserve up")
    finally:
        u.close()


def test_a_node_that_cannot_start_crash_loops_in_pdserve_status(tmp_path, real_model_store):
    locations, name = real_model_store
    (tmp_path / "pdserve.toml").write_text("[node]\nmax_num_seqs = 0\n")  # the node refuses it; `up` passes it on
    u = Up(tmp_path, list(locations), name, "--both", "1", "--config", str(tmp_path / "pdserve.toml"))
    try:
        u.proc.wait_ready(timeout=60, path="/health")
        deadline = time.monotonic() + 60
        while not [n for n in u.status()["supervisor"]["nodes"] if n["crashes"] >= 2 and n["pid"] is None]:
            assert time.monotonic() < deadline, u.status()
            u.nodes()
            time.sleep(0.1)
        out = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", u.url], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        (row,) = [i for i, ln in enumerate(lines) if ln.startswith("both-0 ")]
        assert "exited with code 2; restart in" in lines[row], out.stdout
        assert "max_num_seqs" in "\n".join(lines[row + 1 :]), out.stdout  # the node's last log lines
        u.proc.p.send_signal(signal.SIGTERM)
        assert u.proc.p.wait(60) == 0
        assert not alive(u.seen)
    finally:
        u.close()
