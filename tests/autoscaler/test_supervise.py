"""The local actuator supervises its nodes like a kubelet: the restart backoff as a pure piece on a
fake clock, then real `pdserve node` processes on the tiny model (token ids only).

- RestartBackoff: 1, 2, 4 ... capped; a restart ready for reset_after_s forgets the crashes.
- kill -9 of a node the actuator was asked for: restarted in the same slot (new pid, registered
  again), one restart counted, never more nodes than asked for.
- a node that cannot start (a bad flag: it exits at once) crash-loops: each restart waits at least the
  backoff's delay, the delays double, status() shows the loop with the node's last log lines,
  and close() leaves no process.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from autoscaler.backoff import Backoff, RestartBackoff
from tests.services import wait_for

TOKEN = "supervise-test-token"


# --- the pure piece ----------------------------------------------------------------------
def test_restart_backoff_doubles_up_to_its_cap_and_resets_after_staying_ready():
    b = RestartBackoff(Backoff(base_s=1.0, max_s=8.0), reset_after_s=60.0)
    now, delays = 100.0, []
    for _ in range(6):
        delays.append(b.failure(now, "exited with code 1"))
        assert not b.ready(now) and b.waiting(now) == delays[-1]
        now += delays[-1]
        assert b.ready(now) and b.waiting(now) == 0
        b.started()
    assert delays == [1, 2, 4, 8, 8, 8]
    assert (b.restarts, b.failures, b.repeated) == (6, 6, True)
    assert not b.healthy(ready_since=now, now=now + 59.9) and b.failures == 6  # not long enough
    assert b.healthy(ready_since=now, now=now + 60.0) and (b.failures, b.last_error) == (0, "")
    assert b.failure(now + 61, "exited with code 1") == 1.0  # a new crash loop starts from the first delay
    assert b.restarts == 6  # restarts are history: never reset


def test_restart_settings_are_checked():
    from autoscaler.local import LocalConfig

    with pytest.raises(ValueError):
        RestartBackoff(Backoff(), reset_after_s=0)
    with pytest.raises(ValueError):
        LocalConfig(restart_backoff_s=5, restart_backoff_max_s=1)
    with pytest.raises(ValueError):
        LocalConfig(supervise_interval_s=0)


# --- real processes ----------------------------------------------------------------------
def _actuator(tmp_path, store, model, **kw):
    from autoscaler.local import LocalActuator, LocalConfig

    ready, gone = [], []
    cfg = LocalConfig(model=model, store=list(store), internal_token=TOKEN, threads=1, kv_blocks=128,
                      log_dir=str(tmp_path / "logs"), ready_timeout_s=60, stop_timeout_s=5, **kw)  # fmt: skip
    act = LocalActuator(cfg, on_ready=lambda n: ready.append((time.monotonic(), n.url)),
                        on_gone=lambda n: gone.append((time.monotonic(), n.url)))  # fmt: skip
    return act, ready, gone


def _pids(act) -> set[int]:
    return {p.proc.pid for p in act.nodes}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_node_is_restarted_in_its_slot(tmp_path, tiny_model_store):
    act, ready, gone = _actuator(tmp_path, *tiny_model_store, restart_backoff_s=0.2)
    procs = []
    try:
        act.scale("both", 1)
        wait_for(lambda: len(ready) == 1, 60, "the node to be ready")
        (before,) = act.status()["nodes"]
        procs += [p.proc for p in act.nodes]
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: len(ready) == 2, 60, "the restarted node to be ready")
        procs += [p.proc for p in act.nodes]
        (after,) = act.status()["nodes"]
        assert (after["slot"], after["state"], after["restarts"]) == (before["slot"], "ready", 1)
        assert after["last_exit"] == "killed by SIGKILL" and after["pid"] != before["pid"]
        assert [url for _, url in gone] == [before["url"]] and ready[1][1] == after["url"]
        assert ready[1][0] - gone[0][0] >= 0.2 - 0.05  # it waited its backoff (the reap is timed just after)
        assert act.replicas("both") == 1 and len(act.current()["both"]) == 1 and len(act.nodes) == 1
    finally:
        stopped = act.close()
    assert stopped == [f"both pid {after['pid']}"]
    assert all(p.poll() is not None for p in procs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_that_cannot_start_crash_loops_backing_off(tmp_path, tiny_model_store):
    base, cap = 0.3, 1.2
    act, _, gone = _actuator(tmp_path, *tiny_model_store, restart_backoff_s=base, restart_backoff_max_s=cap,
                             extra_args=("--threads", "many"))  # fmt: skip
    starts, procs, most = [], [], [0]
    real_start = act.start

    def start(role, slot=None):  # a spy: when each start happens, and every process made
        starts.append(time.monotonic())
        p = real_start(role, slot)
        procs.append(p.proc)
        return p

    act.start = start
    stop_watch = threading.Event()

    def watch_count():  # never more than the one node asked for, at any moment
        while not stop_watch.wait(0.02):
            most[0] = max(most[0], sum(1 for p in procs if p.poll() is None))

    watcher = threading.Thread(target=watch_count, daemon=True)
    watcher.start()
    try:
        act.scale("both", 1)
        wait_for(lambda: len(gone) >= 4 and len(starts) >= 4, 90, "4 crashes and 4 starts")
        (slot,) = act.status()["nodes"]
        gone_at = [t for t, _ in gone]
    finally:
        stop_watch.set()
        stopped = act.close()
        watcher.join(5)
    delays = [min(cap, base * 2**i) for i in range(3)]  # 0.3, 0.6, 1.2
    waited = [starts[i + 1] - gone_at[i] for i in range(3)]
    assert all(w >= d - 0.05 for w, d in zip(waited, delays)), (waited, delays)  # each restart backed off
    assert slot["crashes"] >= 3 and slot["restarts"] >= 3 and slot["last_exit"].startswith("exited with code")
    assert any("invalid int value: 'many'" in line for line in slot["last_log"]), slot["last_log"]
    assert most[0] == 1, f"{most[0]} nodes ran at once"
    assert len(stopped) <= 1 and all(p.poll() is not None for p in procs)
