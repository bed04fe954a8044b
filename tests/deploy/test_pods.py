"""Each overlay's containers, run: their exact command lines start, get ready, answer, drain and stop.

tests/deploy/pods.py runs every container of the pdserve image as a local process (paths, Services and
ports remapped to loopback, Secrets with test values, tests/kubeapi.py as the API server); the store is a
local one with the real model, signed with the Secret's manifest key. A manifest that names a command,
flag, file, route or port the code lacks fails here.
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest

from compute.node.auth import SignedAuth
from tests.deploy.manifests import render
from tests.deploy.netpol import allowed
from tests.deploy.pods import PodFailed, PodRunner

pytestmark = [pytest.mark.slow, pytest.mark.long]  # every manifest's containers run: make test-long
HMAC_KEY = secrets.token_hex(32)


@pytest.fixture(scope="module")
def signed_store(real_model_store, tmp_path_factory):
    """The real model's store (shared with the other real-model tests), its manifests signed with the test
    Secret's key: fragments hard-linked, each manifest rewritten signed (what an operator's re-sign does)."""
    from paramstore import StoreConfig
    from paramstore.manifest import Manifest

    locations, _ = real_model_store
    root = tmp_path_factory.mktemp("signed-store")
    signed = []
    for loc in locations:
        dst = root / Path(loc).name
        shutil.copytree(loc, dst, copy_function=os.link)
        for mf in (dst / "models").rglob("*.json"):
            raw = mf.read_bytes()
            mf.unlink()  # a hard link: write a new file, never through the link into the shared store
            mf.write_bytes(Manifest.from_json(raw, where=str(mf)).to_json(HMAC_KEY.encode()))
        signed.append(str(dst))
    return StoreConfig(locations=signed, k=8, m=3, hmac_key=HMAC_KEY.encode())


def runner(docs, tmp_path, store, **kw) -> PodRunner:
    values = {("pdserve-secrets", "manifest-hmac-key"): HMAC_KEY, ("pdserve-secrets", "api-keys"): "sk-test-one,sk-test-two"}
    return PodRunner(docs, tmp_path, list(store.locations), values, store.k, store.m, **kw)


def _node_load(run: PodRunner, pod) -> dict:
    """GET /load of a node pod (a Pod, or a Deployment's first pod by name)."""
    port = (run.pods[pod] if isinstance(pod, str) else pod).local_port("http")
    r = httpx.get(f"http://127.0.0.1:{port}/load", timeout=5, auth=SignedAuth(run.secret("pdserve-secrets", "internal-token")))
    assert r.status_code == 200, r.text
    return r.json()


def _until(what: str, ok, timeout_s: float, pod=None):
    """Poll ok() every 0.25 s until it is truthy (its value), bounded; a watched pod's exit fails at once."""
    deadline = time.monotonic() + timeout_s
    while not (value := ok()):
        if pod is not None:
            assert pod.proc.poll() is None, f"{pod.deployment} exited: {pod.log_tail()}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.25)
    return value


NODES = ("pdserve-prefill", "pdserve-decode")


def _check_isolation(docs: list[dict], run: PodRunner) -> None:
    """For the pods as they ran (labels, env): the NetworkPolicy lets the gateway, the autoscaler and peer nodes
    reach the node pods (the connections this run made: the gateway's proofs and polls, the autoscaler's
    claims, the KV handoff) and no other pod, of this namespace or another; the internal token is in the
    pods that sign or verify with it, the admin and API keys in the gateway only."""
    policies = [o for o in docs if o["kind"] == "NetworkPolicy"]
    ns = run.namespace
    for name in NODES:
        dst = run.pods[name].labels
        for src in ("pdserve-gateway", "pdserve-autoscaler", *NODES):
            assert allowed(policies, run.pods[src].labels, ns, dst, ns, 8001, "http"), (src, name)
        assert not allowed(policies, {"app.kubernetes.io/name": "some-job"}, ns, dst, ns, 8001, "http")
        assert not allowed(policies, {}, ns, dst, ns, 40123)  # a KV-transfer port, from an unlabelled pod
        assert not allowed(policies, run.pods["pdserve-gateway"].labels, "elsewhere", dst, ns, 8001, "http")
    assert allowed(policies, {"app.kubernetes.io/name": "some-job"}, ns, run.pods["pdserve-gateway"].labels, ns,
                   8000, "http")  # the gateway is the front door: no policy selects it  # fmt: skip
    def holds(pod, var: str, key: str) -> bool:  # the secret is in the file its *_FILE names (never in its env)
        path = pod.env.get(var + "_FILE")
        return bool(path) and os.path.exists(path) and open(path).read().strip() == run.secret("pdserve-secrets", key)

    keys = {"PDSERVE_INTERNAL_TOKEN": "internal-token", "PDSERVE_ADMIN_KEY": "admin-key",
            "PDSERVE_API_KEYS": "api-keys"}  # fmt: skip
    holders = {k: {n for n, p in run.pods.items() if holds(p, k, key)} for k, key in keys.items()}
    values = {run.secret("pdserve-secrets", key) for key in keys.values()}
    assert not [(n, k) for n, p in run.pods.items() for k, v in p.env.items() if v in values]  # not in any env
    assert holders == {"PDSERVE_INTERNAL_TOKEN": {"pdserve-gateway", "pdserve-autoscaler", *NODES},
                       "PDSERVE_ADMIN_KEY": {"pdserve-gateway"}, "PDSERVE_API_KEYS": {"pdserve-gateway"}}, holders


@pytest.mark.parametrize("overlay", ["local", "production"])
def test_every_container_starts_answers_drains_and_stops(overlay, signed_store, tmp_path):
    """Node pods start as standby runtimes; the autoscaler's command claims them through the node API and sizes
    their Deployments for the pool; the gateway answers a chat through them; the decode pod drains; all stop."""
    import tomllib

    from openai import OpenAI

    docs = render(overlay)
    (cm,) = [o for o in docs if o["kind"] == "ConfigMap"]
    knobs = tomllib.loads(cm["data"]["pdserve.toml"]).get("autoscaler", {})
    t0 = time.monotonic()
    with runner(docs, tmp_path, signed_store) as run:
        assert set(run.pods) == {"pdserve-gateway", *NODES, "pdserve-autoscaler"}
        run.start(only={"pdserve-gateway", *NODES})  # the autoscaler later: first, the nodes as they start
        ready_s = run.wait_ready(timeout_s=150)
        for name in NODES:  # ready = the runtime is up: empty, no model loaded
            load = _node_load(run, name)
            assert (load["state"], load["models"], load["ready"]) == ("standby", {}, False), load
        gw = run.pods["pdserve-gateway"]
        url = f"http://127.0.0.1:{gw.local_port('http')}"
        auth = SignedAuth(run.secret("pdserve-secrets", "internal-token"))

        def status() -> dict:
            r = httpx.get(url + "/internal/status", timeout=5, auth=auth)
            assert r.status_code == 200, r.text
            return r.json()

        def registered() -> bool:  # the gateway found both nodes through the EndpointSlice watch, not a static list
            return {n["role"] for n in status()["nodes"] if n["source"] == "kubernetes"} == {"prefill", "decode"}

        def decided() -> dict | None:  # the autoscaler's decision for the model's keys, published to the gateway
            roles = ((status().get("autoscaler") or {}).get("decision") or {}).get("roles") or {}
            return roles if {"smollm2/prefill", "smollm2/decode"} <= set(roles) else None

        def holding() -> bool:
            return all(_node_load(run, n)["models"].get("smollm2", {}).get("state") == "ready" for n in NODES)

        _until("the gateway registers both node pods", registered, 30, gw)
        run.start()  # the autoscaler: `pdserve autoscale --actuator kubernetes`, the API twin as its cluster
        scaler = run.pods["pdserve-autoscaler"]
        roles = _until("the autoscaler's first decision for smollm2", decided, 60, scaler)
        lows = {role: int(knobs.get(f"{role}_min_replicas", 1)) for role in ("prefill", "decode")}
        if not any(lows.values()):  # may scale to zero: nothing is placed while no request came
            assert {k: d["replicas"] for k, d in roles.items()} == {"smollm2/prefill": 0, "smollm2/decode": 0}
            assert all(_node_load(run, n)["models"] == {} for n in NODES)
        else:  # each role's minimum is placed without a request: claimed through the node API
            _until("the standby pods claimed for smollm2", holding, 60, scaler)
        t_chat = time.monotonic()
        # one retry, as a client honouring the activator's 503 Retry-After would: the hold is bounded by the
        # gateway's queue_timeout_s, which a box this busy may pass while a model loads
        client = OpenAI(base_url=url + "/v1", api_key="sk-test-two", max_retries=1, timeout=90)
        try:  # local: held by the gateway until the autoscaler has claimed standby pods for it (scale from zero)
            reply = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16, temperature=0,
            )  # fmt: skip
        except Exception as e:
            logs = "\n".join(f"--- {p.deployment}\n{p.log_tail(15)}" for p in (scaler, *(run.pods[n] for n in NODES)))
            raise AssertionError(f"no answer through the claimed pods: {e}\n{logs}") from e
        chat_s = time.monotonic() - t_chat
        assert "Paris" in reply.choices[0].message.content, reply
        assert scaler.proc.poll() is None, scaler.log_tail()
        assert holding()  # the autoscaler's pool injected the model into the standby pods
        _check_isolation(docs, run)
        # ... and sized each node Deployment for the pool (autoscaler/pool.py's refill): the pods holding a model
        # (here the one pod this runner runs per Deployment) + the claims still waiting for a pod, or, when none
        # waits, pool_size standby pods. The twin records spec.replicas; the runner starts no further pod.
        pool = int(knobs.get("pool_size", 1))
        for role, name in zip(("prefill", "decode"), NODES):
            waiting = max(1, lows[role]) - 1  # one chat needs one replica: the minimum, if more, waits
            want = 1 + (waiting or pool)
            _until(f"{name} sized to {want} pods", lambda n=name, w=want: run.api.replicas[n] == w, 30, scaler)
        patches = [r for r in run.api.requests if r["method"] == "PATCH"]
        assert patches and all(r["query"].get("fieldManager") == ["pdserve-autoscaler"]
                               for r in patches if "/scale" in r["path"])  # fmt: skip
        # scale-down of the decode pod: its preStop drains it
        hook = run.prestop("pdserve-decode")
        assert hook.returncode == 0, f"preStop failed: {hook.stderr[-2000:]}"
        node = run.pods["pdserve-decode"]
        ready = httpx.get(f"http://127.0.0.1:{node.local_port('http')}/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["draining"] is True, ready.text
        killed = run.stop()
        assert killed == [], f"needed SIGKILL after the grace period: {killed}"
    for pod in run.pods.values():
        assert pod.proc.poll() is not None, f"{pod.deployment} still running"
    print(f"{overlay}: nodes ready (standby) in {ready_s:.1f} s, chat through the claimed pods in {chat_s:.1f} s, "
          f"whole run {time.monotonic() - t0:.1f} s")


def test_the_node_deployments_follow_the_pool_and_a_scale_down_removes_the_standby_pod(signed_store, tmp_path):
    """The runner as the ReplicaSet controller too (tests/deploy/pods.py reconcile): the local overlay, with the
    model's idle time cut to 20 s. A chat claims the first pod of each role; the pool then asks each Deployment for
    one more pod (its standby), which starts empty; once the model idles out it is unloaded (both pods are standby
    again), the Deployments go back to pool_size, and the pod removed is the one the autoscaler marked with the
    low pod-deletion-cost: the never-used standby pod, not the one whose node cache holds the model."""
    from openai import OpenAI

    docs = copy.deepcopy(render("local"))
    (cm,) = [o for o in docs if o["kind"] == "ConfigMap"]
    text = cm["data"]["pdserve.toml"]
    assert "scale_to_zero_after_s = 300.0" in text
    cm["data"]["pdserve.toml"] = text.replace("scale_to_zero_after_s = 300.0", "scale_to_zero_after_s = 20.0")
    with runner(docs, tmp_path, signed_store) as run:
        run.start()
        run.wait_ready(timeout_s=150)
        scaler = run.pods["pdserve-autoscaler"]
        url = f"http://127.0.0.1:{run.pods['pdserve-gateway'].local_port('http')}/v1"
        client = OpenAI(base_url=url, api_key="sk-test-two", max_retries=1, timeout=90)

        def chat(n: int) -> str:
            reply = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=n, temperature=0)  # fmt: skip
            return reply.choices[0].message.content

        assert "Paris" in chat(16)  # from zero: held until the autoscaler claimed the first pods
        last = [time.monotonic()]

        def grown() -> bool:  # each Deployment at 2 pods, the new one up; the model kept busy meanwhile
            for dep in NODES:
                run.reconcile(dep, limit=2)
            if time.monotonic() - last[0] > 5:
                chat(1)
                last[0] = time.monotonic()
            return all(len(ps := run.replicas_of(d)) == 2 and all(p.ready for p in ps) for d in NODES)

        _until("a standby pod per node Deployment, started by the ReplicaSet", grown, 150, scaler)
        for dep in NODES:
            first, new = run.replicas_of(dep)
            assert _node_load(run, first)["models"]["smollm2"]["state"] == "ready"
            load = _node_load(run, new)
            assert (load["state"], load["models"]) == ("standby", {}), load  # a new pod starts empty

        def shrunk() -> bool:  # idle 20 s: unloaded, each Deployment back to pool_size, its surplus pod deleted
            for dep in NODES:
                run.reconcile(dep, limit=2)
            return all(len(run.replicas_of(d)) == 1 for d in NODES)

        _until("the idle model unloaded and a pod per Deployment removed", shrunk, 90, scaler)
        marks = [(r["path"].rsplit("/", 1)[1], r["body"]["metadata"]["annotations"]) for r in run.api.requests
                 if r["method"] == "PATCH" and "/pods/" in r["path"]]  # fmt: skip
        for dep in NODES:
            (left,) = run.replicas_of(dep)
            assert left.name == f"{dep}-0" and run.api.replicas[dep] == 1
            load = _node_load(run, left)
            assert load["state"] == "standby" and load["cached"].get("smollm2", 0) > 0, load  # its cache kept
            assert (f"{dep}-1", {"controller.kubernetes.io/pod-deletion-cost": "-1000"}) in marks, marks
        assert run.stop() == []


def _gateway_only(docs, mutate) -> list[dict]:
    docs = copy.deepcopy(docs)
    for o in docs:
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-gateway":
            mutate(o["spec"]["template"]["spec"]["containers"][0])
    return docs


@pytest.mark.parametrize("what, mutate, match", [
    ("a flag the command lacks", lambda c: c["args"].append("--no-such-flag"), "exited with 2"),
    ("a command that does not exist", lambda c: c["args"].__setitem__(0, "serve"), "exited with 2"),
    ("a route the gateway does not serve", lambda c: c["readinessProbe"]["httpGet"].__setitem__("path", "/drain"),
     "not ready"),
    ("a port no container declares", lambda c: c["readinessProbe"]["httpGet"].__setitem__("port", "metrics"),
     "no containerPort"),
    ("a config file that is not mounted", lambda c: c["args"].__setitem__(-1, "/etc/pdserve/other.toml"),
     "exited with 2"),
])  # fmt: skip
def test_a_manifest_naming_what_the_code_lacks_fails(what, mutate, match, signed_store, tmp_path):
    docs = _gateway_only(render("local"), mutate)
    with runner(docs, tmp_path, signed_store, only={"pdserve-gateway"}) as run, pytest.raises(PodFailed, match=match):
        run.start()
        run.wait_ready(timeout_s=12)  # the unchanged gateway is ready in a few seconds


def test_a_prestop_hook_naming_a_route_the_node_lacks_fails(signed_store, tmp_path):
    """The hook the manifests first shipped (POST /drain): the node serves /internal/drain only."""

    def old_route(docs):
        for o in docs:
            if o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-decode":
                cmd = o["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
                cmd[-1] = cmd[-1].replace("/internal/drain", "/drain")
        return docs

    docs = old_route(copy.deepcopy(render("local")))
    with runner(docs, tmp_path, signed_store, only={"pdserve-decode"}) as run:
        run.start()
        run.wait_ready(timeout_s=120)
        hook = run.prestop("pdserve-decode")
        assert hook.returncode != 0 and "404" in hook.stderr, hook


# variables read by libraries, not by pdserve's own code
LIBRARY_ENV = {"AWS_SHARED_CREDENTIALS_FILE", "KUBECONFIG", "PATH", "PYTHONUNBUFFERED",
               "PYTHONDONTWRITEBYTECODE", "TOKENIZERS_PARALLELISM"}  # fmt: skip


def _print_config(pod, argv: list[str], env: dict) -> tuple[int, str]:
    """The container's command with --print-config (its resolved settings, secrets as set or not): (exit, output)."""
    import subprocess

    pod.dir.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([*argv, "--print-config"], env=env, cwd=pod.dir, capture_output=True, text=True, timeout=60,
                       check=False)  # fmt: skip
    return r.returncode, r.stdout if r.returncode == 0 else r.stderr


@pytest.mark.parametrize("overlay", ["local", "production"])
def test_every_environment_variable_set_configures_a_container(overlay, signed_store, tmp_path):
    """An env var the manifests (or the image) set must configure something. Each container's own command line
    (as the pod runner plans it) runs with --print-config, once as planned and once without the variable: the
    resolved settings must differ (or the command refuse to start). A variable a container's env sets must
    configure that container; one the image sets, some container. PDSERVE_CONFIG beside a --config flag naming
    the same file (what `pdserve status` / `chat` run in the container read): without the flag, the variable
    alone must give the same settings, and nothing without both."""
    with runner(render(overlay), tmp_path, signed_store) as run:
        run.plan()
        image = set(run.image_env) - LIBRARY_ENV
        read_by: dict[str, set[str]] = {}  # variable -> the Deployments whose settings it changes
        own: dict[str, set[str]] = {}  # Deployment -> the variables its container's env sets
        for dep, pod in run.pods.items():
            base = _print_config(pod, pod.argv, pod.env)
            assert base[0] == 0, (dep, base)
            own[dep] = {e["name"] for e in pod.container.get("env", [])} - LIBRARY_ENV
            for name in sorted(own[dep] | image):
                without = {k: v for k, v in pod.env.items() if k != name}
                for e in pod.container.get("env", []):  # a value that names it, $(NAME): left unexpanded, as then
                    if f"$({name})" in str(e.get("value", "")):
                        without[e["name"]] = run.remap(pod, str(e["value"]))
                argv = pod.argv
                if name == "PDSERVE_CONFIG" and "--config" in argv:
                    i = argv.index("--config")
                    argv = argv[:i] + argv[i + 2 :]
                    assert _print_config(pod, argv, pod.env) == base, f"{dep}: $PDSERVE_CONFIG is not --config"
                if _print_config(pod, argv, without) != base:
                    read_by.setdefault(name, set()).add(dep)
    unread = sorted((dep, n) for dep, names in own.items() for n in names if dep not in read_by.get(n, ()))
    assert not unread, f"set on a container whose command does not read it: {unread}"
    assert image <= set(read_by), f"set by the image, read by no container: {sorted(image - set(read_by))}"
    print({n: sorted(deps) for n, deps in sorted(read_by.items())})
