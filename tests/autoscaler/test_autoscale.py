"""`pdserve autoscale --actuator local` as its own process, against a running `pdserve gateway`.

Real processes on 127.0.0.1: a gateway with no nodes; the autoscaler observes it over HTTP
(GET /internal/status), starts standby runtimes itself (the warm pool) and registers them with
the gateway; the first chat request, held by the gateway while no runtime holds its model, makes
it place the model (scale from zero, across processes) and gets an answer;
concurrent streams make it add a decode replica, never beyond the configured maximum;
`pdserve status` shows its decisions per "model/role"; SIGTERM stops it and every runtime it
started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from compute.node.auth import SignedAuth
from compute.node.launcher import ServiceProc, free_port, service_env
from tests.services import wait_for

pytestmark = pytest.mark.slow
TOKEN = "autoscale-test-token"
AUTH = SignedAuth(TOKEN)
PDSERVE = [sys.executable, "-m", "autoscaler.cli"]


def write_config(tmp_path, locations: list[str], model: str, port: int) -> str:
    path = tmp_path / "pdserve.toml"
    path.write_text(f"""
[store]
locations = [{", ".join(f'"{u}"' for u in locations)}]
[node]
threads = 1
kv_blocks = 256
model = "{model}"  # a node of its own would load it at start; the pool's runtimes (--standby) start empty
tpot_target_s = 0.001  # no batch meets it: each node measures that it carries 1 stream at its target
[gateway]
model = "{model}"
port = {port}
url = "http://127.0.0.1:{port}"
[autoscaler]
tick_s = 0.5
target_running_streams_per_replica = 32  # the fallback alone would keep 1 decode replica
stable_window_s = 4.0
panic_window_s = 1.0
scale_down_delay_s = 600.0
prefill_min_replicas = 1
prefill_max_replicas = 1
decode_min_replicas = 1
decode_max_replicas = 2
[autoscaler.local]
cores = 3  # declared: the scale-up on measured load is this test's subject, not the capacity bound (whose own
# tests are tests/autoscaler/test_capacity*.py): on a busy 2-core box the bound would hold it at 2 serving nodes
log_dir = "{tmp_path / "nodes"}"
ready_timeout_s = 180.0
""")
    return str(path)


def status(url: str) -> dict:
    r = httpx.get(url + "/internal/status", auth=AUTH, timeout=5)
    r.raise_for_status()
    return r.json()


def by_role(decision: dict) -> dict[str, dict]:
    """A published decision's per-key entries by role (one model here; keys are "model/role")."""
    return {d["role"]: d for d in decision["roles"].values()}


def ready_nodes(st: dict, role: str) -> list[str]:
    """Runtimes of `role` with a model ready (the only model here)."""
    return [n["url"] for n in st["nodes"] if n["role"] == role and n["state"] == "ready"]


def serving(st: dict, role: str) -> list[str]:
    """Runtimes of `role` holding a model (not the pool's standby ones)."""
    return [n["url"] for n in st["nodes"] if n["role"] == role and n["state"] != "standby"]


def test_autoscale_process_observes_gateway_over_http_and_scales_within_bounds(tmp_path, real_model_store):
    import openai

    locations, model = real_model_store
    port = free_port()
    cfg = write_config(tmp_path, locations, model, port)
    env = service_env(TOKEN, PDSERVE_CONFIG=cfg, PDSERVE_ADMIN_KEY="test-admin-key")  # `pdserve status` reads it too
    gw = ServiceProc("gateway", PDSERVE + ["gateway", "--log-level", "warning"], f"http://127.0.0.1:{port}",
                     str(tmp_path), env)  # fmt: skip
    scaler = None
    try:
        gw.wait_ready(60, path="/health")  # no nodes yet: /ready is 503 until the autoscaler starts some
        assert httpx.get(gw.url + "/internal/status", timeout=5).status_code == 401  # internal token required
        scaler = ServiceProc("autoscale", PDSERVE + ["autoscale", "--actuator", "local", "--log-level", "info"],
                             gw.url, str(tmp_path), env)  # fmt: skip

        # the pool's standby runtimes, started by the autoscaler and registered with the gateway
        st = wait_for(lambda: (s := status(gw.url)) and {n["role"] for n in s["nodes"] if n["state"] == "standby"}
                      == {"prefill", "decode"} and s, 240, "a standby prefill and decode runtime", every=0.25)  # fmt: skip
        assert all(n["source"] == "autoscaler" for n in st["nodes"]) and not ready_nodes(st, "decode")
        # the first request: held at the gateway (demand the autoscaler observes), the model placed, answered
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=question)
        assert "Paris" in answer.choices[0].message.content
        assert ready_nodes(status(gw.url), "prefill") and ready_nodes(status(gw.url), "decode")

        # load: 3 streams on one decode replica that measured it carries 1 at its TPOT target -> 2 decode
        # replicas (the maximum); the configured fallback (32 per replica) would keep 1: the measure decides
        seen = {"decode_nodes": 0, "asked": 0}
        done = threading.Event()

        def stream():
            story = [{"role": "user", "content": "Tell me a long story."}]
            s = client.chat.completions.create(model=model, max_tokens=400, stream=True, messages=story,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            for _ in s:
                if done.is_set():
                    break
            s.close()

        streams = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
        for t in streams:
            t.start()

        def scaled():
            s = status(gw.url)
            seen["decode_nodes"] = max(seen["decode_nodes"], len(serving(s, "decode")))
            a = s.get("autoscaler") or {}
            asked = (a.get("asked") or {}).items()  # keys "model/role" (a plain role from a role-level actuator)
            seen["asked"] = max([seen["asked"], *[v for k, v in asked if k.rsplit("/", 1)[-1] == "decode"]])
            return len(ready_nodes(s, "decode")) == 2 and s

        st = wait_for(scaled, 180, "a second ready decode node", every=0.25)
        done.set()
        for t in streams:
            t.join(60)
        scaled_at = time.time()  # the gateway's clock too (one machine): the decisions after this are fresh
        for _ in range(8):  # a few more ticks at full load: still bounded at the maximum
            scaled()
            time.sleep(0.5)
        assert seen == {"decode_nodes": 2, "asked": 2}, seen
        # the loop goes on publishing: a report received after the scale-up, however long a tick takes here
        wait_for(lambda: (status(gw.url).get("autoscaler") or {}).get("received", 0) > scaled_at, 120,
                 "an autoscaler report after the scale-up", every=0.25)  # fmt: skip

        # `pdserve status` shows the autoscaler's decision, fresh (received after the scale-up)
        r = subprocess.run(PDSERVE + ["status", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        a = json.loads(r.stdout)["autoscaler"]
        assert a["actuator"] == "local" and a["received"] > scaled_at, (a, scaled_at)
        assert by_role(a["decision"])["decode"]["replicas"] == 2 and a["reason"]
        r = subprocess.run(PDSERVE + ["status"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "autoscaler (local" in r.stdout, r.stdout

        # SIGTERM: the loop stops and every runtime it started is stopped and deregistered
        nodes = [n["url"] for n in status(gw.url)["nodes"]]
        assert len(nodes) >= 3  # 1 prefill + 2 decode replicas, and the pool's standby runtimes
        scaler.p.send_signal(signal.SIGTERM)
        assert scaler.p.wait(60) == 0, scaler.log()
        assert "stopped after" in scaler.log()
        for url in nodes:
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2)
        assert status(gw.url)["nodes"] == []
    finally:
        if scaler is not None:
            scaler.stop()
        gw.stop()


def test_autoscale_kubernetes_finds_gateway_pods_and_patches_deployments(tmp_path, real_model_store):
    """`--actuator kubernetes` against the API twin: gateway pods from their EndpointSlices, scale by PATCH."""
    from tests import kubeapi

    locations, model = real_model_store
    port, ns = free_port(), "pdserve-test"
    gateway_pod = kubeapi.endpoint_slice("pdserve-gateway", "gw", [("127.0.0.1", True, False, "gateway-0")], ns, port)
    api = kubeapi.KubeApiTwin(ns, {"pdserve-prefill": 1, "pdserve-decode": 1}, [gateway_pod])
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "twin",
        "clusters": [{"name": "twin", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "twin", "context": {"cluster": "twin", "user": "u", "namespace": ns}}]}))  # fmt: skip
    cfg = tmp_path / "pdserve.toml"
    cfg.write_text(f"""
[store]
locations = [{", ".join(f'"{u}"' for u in locations)}]
[gateway]
model = "{model}"
port = {port}
[autoscaler]
actuator = "kubernetes"
tick_s = 0.3
prefill_min_replicas = 2
[autoscaler.kubernetes]
namespace = "{ns}"
gateway_service = "pdserve-gateway"
""")
    env = service_env(TOKEN, PDSERVE_CONFIG=str(cfg))
    gw = ServiceProc("gateway", PDSERVE + ["gateway", "--log-level", "warning"], f"http://127.0.0.1:{port}",
                     str(tmp_path), env)  # fmt: skip
    try:
        gw.wait_ready(60, path="/health")
        r = subprocess.run(PDSERVE + ["autoscale", "--kubeconfig", str(kubeconfig), "--max-ticks", "6"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0 and "stopped after 6 tick(s)" in r.stderr, r.stderr
        # [gateway] model placed at each role's minimum: 2 prefill runtimes asked for (no pod answers here, so
        # the claims wait: the pool sizes for them, capacity first, before any standby)
        assert api.replicas == {"pdserve-prefill": 2, "pdserve-decode": 1}, r.stderr
        patches = [q for q in api.requests if q["method"] == "PATCH"]
        assert [q["path"].rsplit("/", 2)[-2] for q in patches] == ["pdserve-prefill"]
        assert all(kubeapi.SCALE.match(q["path"]) or kubeapi.SLICES.match(q["path"]) for q in api.requests)
        a = status(gw.url)["autoscaler"]  # published to the gateway pod it found
        assert a["actuator"] == "kubernetes" and by_role(a["decision"])["prefill"]["replicas"] == 2
    finally:
        gw.stop()
        api.close()


def test_up_autoscale_runs_the_same_observer_in_process(tmp_path, real_model_store):
    """`pdserve up --autoscale` (one colocated node, the default): the loop observes the gateway's own snapshot; `pdserve status` shows each tick."""
    locations, model = real_model_store
    port = free_port()
    cfg = write_config(tmp_path, locations, model, port)
    env = service_env(TOKEN, PDSERVE_CONFIG=cfg)
    up = ServiceProc("up", PDSERVE + ["up", "--autoscale", "--log-dir", str(tmp_path / "up-nodes")],
                     f"http://127.0.0.1:{port}", str(tmp_path), env)  # fmt: skip
    try:
        up.wait_ready(240)  # the default's one colocated node, registered

        def published():
            r = subprocess.run(PDSERVE + ["status", "--json"], env=env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout).get("autoscaler") or None

        first = wait_for(published, 30, "an autoscaler report", every=0.25)
        assert first["actuator"] == "local" and first["reason"], first
        assert set(by_role(first["decision"])) == {"both"}  # the default topology, sized like a split's roles
        later = wait_for(lambda: (a := published()) and a["t"] > first["t"] and a, 30, "a later tick's report", every=0.25)
        assert {r: d["replicas"] for r, d in by_role(later["decision"]).items()} == {"both": 1}
        held = {n["url"] for ns in later["nodes"].values() for n in ns}  # the pool's replicas: runtimes holding it
        assert held and held <= {n["url"] for n in status(up.url)["nodes"]}  # every one registered with the gateway
    finally:
        up.stop()
