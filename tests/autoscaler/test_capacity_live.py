"""The capacity bound and the replacement of a dead node, on real processes (loopback, the real model; every
process started is stopped). The pure rule and the policy's stage 6: tests/autoscaler/test_capacity.py.

- a burst on a service whose machine allows N serving nodes (2 cores, 1 thread per node: N = 2) never runs
  more than N serving nodes (+ the pool's standby), though the load asks for 8; the decision line says
  which bound held it back;
- kill -9 of the decode node that holds the model, under load: back to full strength (the gateway sees the
  plan's nodes with the model ready) sooner than the killed slot's own restart becomes ready in the same run
  (what a replacement without the warm pool would take), and every request of the load completes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import httpx
import pytest

from tests.procs import alive, children, kill_left, started
from tests.services import admin_headers, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]  # bursts and kills under load: make test-long
TOKEN = "capacity-test-token"


@pytest.mark.timeout(420)
def test_a_burst_never_runs_more_serving_nodes_than_the_machine_allows(tmp_path, real_model_store):
    from autoscaler.config import AutoscalerConfig
    from autoscaler.local import LocalActuator, LocalConfig
    from autoscaler.loop import ControlLoop
    from autoscaler.policy import RoleLoad
    from autoscaler.pool import PoolConfig, RuntimePool

    locations, model = real_model_store
    key = (model, "decode")
    act = LocalActuator(LocalConfig(model=None, store=list(locations), internal_token=TOKEN, threads=1, kv_blocks=128,
                                    log_dir=str(tmp_path / "logs"), ready_timeout_s=240, stop_timeout_s=5,
                                    drain_timeout_s=10, import_nice=10, cores=2.0))  # fmt: skip
    act._cpu = types.SimpleNamespace(sample=lambda **kw: None)  # the static count: N = 2 cores / 1 thread
    pool = RuntimePool(act, TOKEN, PoolConfig(pool_size=1, max_runtimes={"decode": 8}, unload_timeout_s=10),
                       roles=("decode",))  # fmt: skip
    cfg = AutoscalerConfig(tick_s=0.5, target_running_streams_per_replica=4, stable_window_s=10.0, panic_window_s=2.0,
                           decode_min_replicas=1, decode_max_replicas=8, scale_to_zero_after_s=0)  # fmt: skip
    streams, seen, most = [0], {}, {"processes": 0, "serving": 0}
    loop = ControlLoop(cfg, lambda: {key: RoleLoad(model=model, running_streams=streams[0])}, pool)

    def tick():
        report = loop.tick()
        assert not report.error, report
        seen.update({p.proc.pid: seen.get(p.proc.pid) or started(p.proc.pid) for p in act.nodes})
        most["processes"] = max(most["processes"], len(alive(seen)))
        most["serving"] = max(most["serving"], len(pool.current().get(key, [])))
        return report

    def ticking(fn, timeout, what):
        def once():
            tick()
            return fn()
        return wait_for(once, timeout, what, every=0.2)

    try:
        ticking(lambda: any(n.ready for n in pool.current().get(key, [])), 240, "the first replica")
        ticking(lambda: any(r["state"] == "standby" for r in pool.status()["runtimes"]), 240, "a standby runtime")
        streams[0] = 200  # 50 replicas' worth: the load wants the max, 8
        ticking(lambda: len([n for n in pool.current().get(key, []) if n.ready]) == 2, 120, "the standby claimed")
        t_end = time.monotonic() + 20  # the refill starts, the burst goes on: nothing more may start
        while time.monotonic() < t_end:
            report = tick()
            time.sleep(0.2)
        d = report.decision.roles[key]
        assert (d.current, d.replicas) == (2, 2), d
        assert d.reason.startswith("bounds: machine: 2 cores, 1 thread per node → at most 2 serving nodes "
                                   "(load wants 8: "), d.reason  # fmt: skip
        assert [b.to_dict()["limit"] for b in report.capacity] == [2]
        assert most["serving"] == 2 and most["processes"] <= 2 + 1, (most, seen)  # N, + the pool's standby
    finally:
        pool.close()
        act.close()
    assert not alive(seen), f"left running: {alive(seen)}"


@pytest.mark.timeout(400)
def test_a_killed_node_under_load_is_back_sooner_than_its_own_restart(tmp_path, real_model_store):
    from compute.node.launcher import Services

    locations, model = real_model_store
    os.makedirs(tmp_path / "logs", exist_ok=True)
    svc = Services(list(locations), model, str(tmp_path), TOKEN)
    up = svc.start("up", ["up", "--log-dir", str(tmp_path / "logs"), "--prefill", "1", "--decode", "1"])
    seen: dict[int, str] = {}
    http = httpx.Client(timeout=10)

    def status() -> dict:
        seen.update(children(up.p.pid))
        return http.get(up.url + "/admin/status", headers=admin_headers(up.url)).json()

    def ready_on(st: dict) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in st.get("nodes", []):
            if n.get("state") != "unhealthy" and (n.get("models") or {}).get(model) == "ready":
                out.setdefault(n["role"], []).append(n["url"])
        return out

    stop, results = threading.Event(), []

    def client():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 24}
                r = c.post(up.url + "/v1/chat/completions", json=body)
                results.append(r.status_code)

    try:
        up.wait_ready(timeout=180)
        wait_for(lambda: (st := status()) and all(len(ready_on(st).get(r, [])) == 1 for r in ("prefill", "decode"))
                 and sum(1 for r in st["supervisor"]["pool"]["runtimes"] if r["state"] == "standby") == 2,
                 240, "1 + 1 serving and a standby runtime per role")  # fmt: skip
        threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) >= 3, 60, "the load running")
        st = status()
        (url,) = ready_on(st)["decode"]
        (slot,) = [n for n in st["supervisor"]["nodes"] if n["url"] == url]
        t0 = time.monotonic()
        os.kill(slot["pid"], signal.SIGKILL)
        back = restart = None
        while back is None or restart is None:
            assert time.monotonic() - t0 < 120, (back, restart, up.log()[-3000:])
            st = status()
            now = time.monotonic() - t0
            ready = ready_on(st)
            if back is None and len(ready.get("decode", [])) == 1 and url not in ready["decode"] and ready.get("prefill"):
                back = now
            mine = [n for n in st["supervisor"]["nodes"] if n["slot"] == slot["slot"]]
            if restart is None and mine and mine[0]["pid"] not in (None, slot["pid"]) and mine[0]["state"] == "ready":
                restart = now
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(120)
        print(f"\nkill -9 of the decode node under load: full strength in {back:.2f} s; its slot's own restart "
              f"ready in {restart:.2f} s; {len(results)} requests")  # fmt: skip
        assert back < restart, (back, restart)  # the pool's standby, not the restart, brought it back
        assert results and set(results) == {200}, results
    finally:
        stop.set()
        http.close()
        try:
            up.stop()
        finally:
            kill_left(seen)
    assert not alive(seen), f"left running: {alive(seen)}"
