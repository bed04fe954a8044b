"""Run the local overlay under podman (`podman kube play`) and ask it a question: the test-deploy driver.

Called by deploy/podman/test-deploy.sh once the image is built. podman 4.3 runs Deployments as pods but
has no Services, no control plane, ignores readinessProbes and mishandles Secrets in the YAML, so this
driver stands in for those parts of a cluster — nothing else about the manifests changes:

 1. render: ``kubectl kustomize deploy/overlays/local``; the pdserve containers keep their image's
    ENTRYPOINT, their args, env, probes and hooks as rendered;
 2. store: SmolLM2 imported on the host (the host's venv) into a directory the pods mount at the same
    path, its manifests signed with the test key; the ConfigMap's [store] table points there;
 3. convert (podman.yaml): configMap / secret / emptyDir volumes become hostPath files and directories
    materialised under the work directory, secretKeyRef env gets test values, the image is the local
    build (imagePullPolicy Never), every containerPort is published on its own free host port on
    127.0.0.1 (podman 4.3 publishes them all; the gateway's is how the client reaches it — no Service); pods that mount a service-account token get $KUBECONFIG,
    pointing at the API twin (tests/kubeapi.py) on the bridge's gateway address;
 4. play; then the endpoints controller: poll each pod's readinessProbe (httpGet, at the pod's IP) and
    publish it as an EndpointSlice of its Service — the gateway's registry watches them as in a cluster;
    a container that keeps exiting (CrashLoopBackOff) fails at once, not at the readiness timeout;
 5. the node pods must be standby runtimes (``GET /load``: no model); a chat request with the ``openai``
    client through the gateway's published port, held by the gateway until the autoscaler container has
    claimed the standby pods (the local overlay places nothing at zero replicas); the node pods then hold the
    model; the decode pod's preStop hook is run inside its container (``podman exec``), and the node must say
    it is draining;
 6. always (success, failure, Ctrl-C): ``podman kube down`` and the pods removed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from compute.node.auth import SignedAuth
from compute.node.launcher import free_port
from tests import kubeapi  # the API twin the tests use
from tests.deploy.pods import with_store  # the pod runner's [store] rewrite

NS = "pdserve"
NODES = ("pdserve-prefill", "pdserve-decode")
BRIDGE_IP = "10.88.0.1"  # podman's default network gateway: the address pods reach the host at


def sh(*cmd, check=True, capture=True, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=capture, text=True, timeout=timeout)


def import_store(work: Path, key: str) -> list[str]:
    """The real model into work/store (k=2, m=1: the local overlay's), signed with `key`."""
    from paramstore import ParamStore, StoreConfig
    from paramstore.realmodel import gguf_path

    root = work / "store"
    cfg = StoreConfig.local_default(str(root), k=2, m=1, hmac_key=key.encode())
    marker = root / ".imported"
    if not marker.exists() or marker.read_text() != key:
        shutil.rmtree(root, ignore_errors=True)
        with ParamStore(cfg) as store:
            store.import_model(gguf_path(), "smollm2")
        marker.write_text(key)
    for dirpath, dirs, files in os.walk(root):  # readable by the pods' uid 10001
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    return cfg.locations


def convert(docs: list[dict], work: Path, image: str, locations: list[str], values: dict, kubeconfig: Path,
            gateway_port: int) -> tuple[list[dict], dict[str, dict]]:  # fmt: skip
    """-> (podman kube objects, deployment -> container spec as rendered)."""
    cms = {o["metadata"]["name"]: o.get("data", {}) for o in docs if o["kind"] == "ConfigMap"}
    out, rendered = [], {}
    for dep in (o for o in docs if o["kind"] == "Deployment"):
        name = dep["metadata"]["name"]
        dep = json.loads(json.dumps(dep))
        spec = dep["spec"]["template"]["spec"]
        dep["spec"]["replicas"] = 1
        (c,) = spec["containers"]
        rendered[name] = json.loads(json.dumps(c))
        c["image"], c["imagePullPolicy"] = image, "Never"
        c.pop("resources", None)  # cgroup limits: not what this test is about (and not enforceable here)
        pod_dir = work / "pods" / name
        vols = []
        for v in spec.get("volumes", []):
            d = pod_dir / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o777)
            if "configMap" in v:
                for key, text in cms[v["configMap"]["name"]].items():
                    if key.endswith(".toml"):
                        text = with_store(text, locations, k=2, m=1)
                    (d / key).write_text(text)
                    os.chmod(d / key, 0o644)
            elif "secret" in v:
                for item in v["secret"].get("items", []):
                    (d / item["path"]).write_text(values[(v["secret"]["secretName"], item["key"])])
                    os.chmod(d / item["path"], 0o644)
            vols.append({"name": v["name"], "hostPath": {"path": str(d), "type": "Directory"}})
        if spec.get("automountServiceAccountToken"):
            kdir = pod_dir / "kube"
            kdir.mkdir(parents=True, exist_ok=True)
            shutil.copy(kubeconfig, kdir / "config")
            os.chmod(kdir / "config", 0o644)
            vols.append({"name": "kubeconfig", "hostPath": {"path": str(kdir), "type": "Directory"}})
            c.setdefault("volumeMounts", []).append({"name": "kubeconfig", "mountPath": "/var/run/pdserve-kube",
                                                     "readOnly": True})  # fmt: skip
            c.setdefault("env", []).append({"name": "KUBECONFIG", "value": "/var/run/pdserve-kube/config"})
        vols.append({"name": "store", "hostPath": {"path": str(work / "store"), "type": "Directory"}})
        c.setdefault("volumeMounts", []).append({"name": "store", "mountPath": str(work / "store"), "readOnly": True})
        spec["volumes"] = vols
        # podman kube play has no status.podIP to fill: the node proves itself for any host on its port (its
        # wildcard bind's identity, compute/node/auth.py) instead of its advertised URL
        c["env"] = [e for e in c.get("env", []) if e["name"] not in ("POD_IP", "PDSERVE_ADVERTISE_URL")]
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                e.pop("valueFrom")
                e["value"] = values[(ref["name"], ref["key"])]
        for p in c.get("ports", []):  # podman 4.3 publishes every containerPort: each gets its own host port
            p["hostPort"] = gateway_port if name == "pdserve-gateway" else free_port()
            p["hostIP"] = "127.0.0.1"
        for k in ("serviceAccountName", "automountServiceAccountToken"):
            spec.pop(k, None)
        out.append(dep)
    return out, rendered


def pod_ip(deployment: str) -> str | None:
    """The IP of the running pod of a played Deployment (podman names the pod <deployment>-pod-0)."""
    r = sh("podman", "ps", "--filter", f"pod={deployment}-pod-0", "--format", "{{.ID}}", check=False)
    for cid in r.stdout.split():
        info = json.loads(sh("podman", "inspect", cid).stdout)[0]
        for net in (info.get("NetworkSettings", {}).get("Networks") or {}).values():
            if net.get("IPAddress"):
                return net["IPAddress"]
    return None


def container_of(deployment: str, container: str) -> str:
    return f"{deployment}-pod-0-{container}"


def crash_loop(deployment: str, container: str) -> str | None:
    """Why a pod's container keeps exiting (restarted twice or more: Kubernetes' CrashLoopBackOff), else None."""
    name = container_of(deployment, container)
    r = sh("podman", "inspect", name, "--format", "{{.RestartCount}}", check=False)
    restarts = int(r.stdout.strip() or 0) if r.returncode == 0 else 0
    if restarts < 2:
        return None
    logs = sh("podman", "logs", "--tail", "5", name, check=False)
    last = (logs.stdout + logs.stderr).strip().splitlines()[-1:] or ["(no output)"]
    return f"{name} keeps exiting ({restarts} restarts): {last[0]}"


def main() -> int:
    ap = argparse.ArgumentParser(prog="deploy/podman/play.py")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--image", default="localhost/pdserve:dev")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for every pod to be ready")
    ap.add_argument("--chat-timeout", type=float, default=180.0,
                    help="seconds for the answer, the autoscaler's placement from zero replicas included")
    args = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM too runs the clean-up below
    work = args.work.resolve()
    t0 = time.monotonic()
    kubectl = shutil.which("kubectl", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    docs = [o for o in yaml.safe_load_all(sh(kubectl, "kustomize", str(ROOT / "deploy/overlays/local")).stdout) if o]
    key = secrets.token_hex(32)
    values = {("pdserve-secrets", "api-keys"): "sk-podman-test", ("pdserve-secrets", "admin-key"): secrets.token_hex(8),
              ("pdserve-secrets", "internal-token"): secrets.token_hex(16), ("pdserve-secrets", "manifest-hmac-key"): key,
              ("pdserve-s3", "credentials"): "[default]\naws_access_key_id = unused\naws_secret_access_key = unused\n"}  # fmt: skip
    print("test-deploy: importing the model into the store the pods mount ...", flush=True)
    locations = import_store(work, key)
    api = kubeapi.KubeApiTwin(NS, {"pdserve-prefill": 1, "pdserve-decode": 1})
    # the twin listens on loopback; the pods reach it through a forwarder on the bridge address only, bound
    # once the bridge exists (after play: until then the gateway and the autoscaler retry, as in a cluster)
    fwd_port = free_port()
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "twin",
        "clusters": [{"name": "twin", "cluster": {"server": f"http://{BRIDGE_IP}:{fwd_port}"}}],
        "users": [{"name": "pod", "user": {"token": "service-account-token"}}],
        "contexts": [{"name": "twin", "context": {"cluster": "twin", "user": "pod", "namespace": NS}}]}))  # fmt: skip
    gw_port = free_port()
    objs, rendered = convert(docs, work, args.image, locations, values, kubeconfig, gw_port)
    play = work / "podman.yaml"
    play.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    services = {o["metadata"]["name"]: o for o in docs if o["kind"] == "Service"}
    ok, fwd = False, None
    try:
        sh("podman", "kube", "down", str(play), check=False)
        r = sh("podman", "kube", "play", "--network", "podman", str(play), check=False)
        if r.returncode != 0:
            why = [x for x in r.stderr.strip().splitlines() if not x.startswith("Error: failed to start")][-1:]
            print(f"{r.stderr}\ntest-deploy: FAILED: podman kube play: {(why or ['?'])[0][-300:]}", file=sys.stderr)
            return 1
        fwd = _Forward(BRIDGE_IP, int(api.url.rsplit(":", 1)[1]), fwd_port)
        print(f"test-deploy: {len(objs)} pods playing; polling their readiness probes", flush=True)
        ready_s = wait_ready(rendered, services, api, args.timeout)
        print(f"test-deploy: every pod ready after {ready_s:.1f} s", flush=True)
        auth = SignedAuth(values[("pdserve-secrets", "internal-token")])
        loads = {d: httpx.get(f"http://{pod_ip(d)}:8001/load", auth=auth, timeout=5).json() for d in NODES}
        if any((x.get("state"), x.get("models")) != ("standby", {}) for x in loads.values()):
            print(f"test-deploy: FAILED: the node pods did not start empty (standby): {loads}", file=sys.stderr)
            return 1
        print("test-deploy: the node pods are standby runtimes (no model yet)", flush=True)
        t_chat = time.monotonic()
        answer = ask(f"http://127.0.0.1:{gw_port}/v1", args.chat_timeout)
        print(f"test-deploy: answer through the gateway container in {time.monotonic() - t_chat:.1f} s "
              f"(from zero replicas: the autoscaler claimed the standby pods meanwhile): {answer!r}")
        held = {d: httpx.get(f"http://{pod_ip(d)}:8001/load", auth=auth, timeout=5).json().get("models", {})
                for d in NODES}  # fmt: skip
        if any(m.get("smollm2", {}).get("state") != "ready" for m in held.values()):
            print(f"test-deploy: FAILED: the node pods do not hold the model: {held}", file=sys.stderr)
            return 1
        if "Paris" not in answer:
            print("test-deploy: FAILED: the answer does not name Paris", file=sys.stderr)
            return 1
        hook = rendered["pdserve-decode"]["lifecycle"]["preStop"]["exec"]["command"]
        r = sh("podman", "exec", container_of("pdserve-decode", "node"), *hook, check=False, timeout=130)
        ip = pod_ip("pdserve-decode")
        state = httpx.get(f"http://{ip}:8001/ready", timeout=5)
        if r.returncode != 0 or state.status_code != 503 or not state.json().get("draining"):
            print(f"test-deploy: FAILED: preStop rc={r.returncode} {r.stderr[-500:]} ready={state.text}", file=sys.stderr)
            return 1
        print("test-deploy: the decode pod's preStop hook drained it")
        ok = True
        print(f"test-deploy: OK in {time.monotonic() - t0:.0f} s (after the image build)")
        return 0
    finally:
        if not ok:
            for name in rendered:
                logs = sh("podman", "logs", "--tail", "15", container_of(name, rendered[name]["name"]), check=False)
                print(f"--- {name}\n{logs.stdout}{logs.stderr}", file=sys.stderr)
        sh("podman", "kube", "down", str(play), check=False)
        if fwd is not None:
            fwd.close()
        api.close()


def ask(base_url: str, timeout_s: float) -> str:
    """The chat question through the gateway, retried on 5xx (a hold that ran out: Retry-After) and connection
    errors until `timeout_s` has passed in all."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="sk-podman-test", max_retries=0)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = client.with_options(timeout=max(1.0, deadline - time.monotonic())).chat.completions.create(
                model="smollm2", max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])  # fmt: skip
            return reply.choices[0].message.content
        except (openai.APIConnectionError, openai.InternalServerError) as e:  # timeouts are connection errors
            if time.monotonic() + 2.0 >= deadline:
                raise SystemExit(f"test-deploy: FAILED: no answer through the gateway in {timeout_s:.0f} s: {e!r}")
            time.sleep(2.0)


def wait_ready(rendered: dict, services: dict, api, timeout_s: float) -> float:
    """The kubelet's readiness probes and the endpoints controller, from the host."""
    t0 = time.monotonic()
    ready: set[str] = set()
    while True:
        for name, c in rendered.items():
            if name in ready:
                continue
            why = crash_loop(name, c["name"])
            if why:
                raise SystemExit(f"test-deploy: FAILED: {why}")
            ip = pod_ip(name)
            if ip is None:
                continue
            probe = c.get("readinessProbe")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            if probe is not None:
                g = probe["httpGet"]
                port = ports[g["port"]] if isinstance(g["port"], str) else g["port"]
                try:
                    if httpx.get(f"http://{ip}:{port}{g['path']}", timeout=2).status_code != 200:
                        continue
                except httpx.HTTPError:
                    continue
            ready.add(name)
            for svc_name, svc in services.items():
                if svc["spec"]["selector"].items() <= {"app.kubernetes.io/name": name}.items():
                    port = svc["spec"]["ports"][0]
                    target = port.get("targetPort", port["port"])
                    sl = kubeapi.endpoint_slice(svc_name, "podman", [(ip, True, False, f"{name}-pod-0")], NS,
                                                port=ports.get(target, target) if isinstance(target, str) else target)
                    api.put_slice(sl)
        if ready == set(rendered):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"test-deploy: FAILED: not ready after {timeout_s:.0f} s: {sorted(set(rendered) - ready)}")
        time.sleep(1.0)


class _Forward:
    """A TCP forwarder from the bridge address to the API twin on loopback (the pods' only way to it)."""

    def __init__(self, host: str, target_port: int, port: int = 0):
        import socket
        import threading

        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.target = target_port
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading

        while not self.closed.is_set():
            try:
                a, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            b = socket.create_connection(("127.0.0.1", self.target))
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=_pipe, args=(x, y), daemon=True).start()

    def close(self):
        self.closed.set()
        self.sock.close()


def _pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass


if __name__ == "__main__":
    raise SystemExit(main())
