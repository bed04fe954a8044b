"""The autoscaler cut off from the gateway: `pdserve autoscale --actuator local` on one host (its nodes beside it),
`pdserve gateway` on another, and a black hole on the gateway's port only, so the gateway still reaches the nodes.

What must hold while cut off: requests are answered (the data path does not go through the autoscaler); the
autoscaler, blind, scales nothing (its ticks fail: no scale-down on missing data, no extra node); a node killed then
is restarted once, not twice. Healed: the restarted node, whose registration was lost in the partition, is
registered again (autoscaler/observer.py ``register_missing``) and serves; the autoscaler's runtimes are exactly the
plan's, the gateway lists exactly them, and its reports arrive again.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest

from compute.node.launcher import ServiceProc, Services
from tests.net.lab import NetLab
from tests.procs import children
from tests.services import AUTH, TOKEN, wait_for

pytestmark = [pytest.mark.long, pytest.mark.skipif(NetLab.why_not() is not None, reason=str(NetLab.why_not()))]
GW_PORT = 8000  # the gateway's host is its own: any port is free there
KEY = "sk-net-test"  # with an API key the gateway listens beyond loopback


def _config(tmp_path, locations: list[str], model: str, gw: str, node_host: str) -> str:
    path = tmp_path / "pdserve.toml"
    path.write_text(f"""
[store]
locations = [{", ".join(f'"{u}"' for u in locations)}]
[node]
threads = 1
kv_blocks = 256
step = "eager"
[gateway]
model = "{model}"
url = "{gw}"
[autoscaler]
tick_s = 0.5
pool_size = 0
scale_down_delay_s = 600.0
prefill_min_replicas = 1
prefill_max_replicas = 1
decode_min_replicas = 1
decode_max_replicas = 1
[autoscaler.local]
host = "{node_host}"
log_dir = "{tmp_path / "nodes"}"
ready_timeout_s = 180.0
restart_backoff_s = 0.5
""")
    return str(path)


def _runtimes(pid: int) -> dict[int, str]:
    """pid -> role of the node processes the autoscaler ``pid`` started (its children)."""
    out = {}
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "node" in argv and "--role" in argv:
            out[child] = argv[argv.index("--role") + 1]
    return out


def _status(gw) -> dict:
    return httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()


def _ready(gw) -> dict[str, str]:
    """url -> role of the nodes the gateway routes to."""
    return {n["url"]: n["role"] for n in _status(gw)["nodes"] if n["state"] == "ready"}


def _ask(gw, model: str) -> str:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_autoscaler_cut_off_from_the_gateway_loses_no_node_and_starts_none_twice(tmp_path, real_model_store):
    locations, model = real_model_store
    lab = NetLab()
    services = Services([], None, str(tmp_path), TOKEN)
    scaler = None
    try:
        g, a = lab.host(), lab.host()
        cfg = _config(tmp_path, locations, model, f"http://{g.address}:{GW_PORT}", a.address)
        env = {"PDSERVE_CONFIG": cfg, "PDSERVE_API_KEYS": KEY}
        gw = services.start("gateway", ["gateway", "--log-level", "warning"], env, port=GW_PORT, on=g)
        gw.wait_ready(60, path="/health")
        scaler = ServiceProc("autoscale", [*a.argv, sys.executable, "-m", "autoscaler.cli", "autoscale", "--model",
                                           model, "--log-level", "info"], gw.url, str(tmp_path),
                             {**services.env, "PDSERVE_CONFIG": cfg})  # fmt: skip
        wait_for(lambda: sorted(_ready(gw).values()) == ["decode", "prefill"], 240, "1 prefill + 1 decode ready")
        want = _ask(gw, model)
        plan = _runtimes(scaler.p.pid)
        assert sorted(plan.values()) == ["decode", "prefill"], plan
        try:
            lab.black_hole_port(g, a, GW_PORT)  # the autoscaler (and only it) cannot reach the gateway
            assert [_ask(gw, model) for _ in range(3)] == [want] * 3  # the data path goes on
            time.sleep(4)  # blind ticks: a few fail at the observer's timeout
            assert _runtimes(scaler.p.pid) == plan  # nothing stopped, nothing started
            decode = next(p for p, r in plan.items() if r == "decode")
            os.kill(decode, signal.SIGKILL)  # its replacement's registration is lost in the partition
            new = wait_for(lambda: (r := _runtimes(scaler.p.pid)) and sorted(r.values()) == ["decode", "prefill"]
                           and decode not in r and r, 60, "the decode node restarted")  # fmt: skip
            wait_for(lambda: "/internal/nodes failed" in scaler.log(), 30, "the restarted node's registration lost")
            assert _runtimes(scaler.p.pid) == new  # restarted once
            assert "cannot observe the gateway" in scaler.log()
        finally:
            lab.heal()
        healed = time.time()
        wait_for(lambda: len(r := _ready(gw)) == 2 and set(r.values()) == {"prefill", "decode"}, 60,
                 "the restarted node registered again and ready")  # fmt: skip
        assert "registering it again" in scaler.log() and "deregistering it" in scaler.log()
        assert _ask(gw, model) == want
        assert _runtimes(scaler.p.pid) == new
        wait_for(lambda: len(_status(gw)["nodes"]) == 2, 30, "the dead node no longer listed")
        wait_for(lambda: ((_status(gw).get("autoscaler") or {}).get("received") or 0) > healed, 30,
                 "an autoscaler report after the partition")  # fmt: skip
    finally:
        if scaler is not None:
            scaler.stop()
        services.stop_all()
        lab.close()
