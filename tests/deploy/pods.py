"""The pod runner: a rendered overlay's pdserve containers run as local processes, as a kubelet would.

No cluster, no image: each container of the pdserve image runs its exact command line, with the
image's ENTRYPOINT and ENV (read from deploy/Dockerfile) and the manifest's args and env, on loopback.

Lifecycle of one run (``PodRunner``):
 1. plan: one pod per Deployment; every containerPort gets a free local port; volumes are
    materialised under the run's directory (configMap keys and Secret items as files, emptyDir as
    directories) and every path under a mountPath is remapped there — in args, env values and the
    mounted files; ``http://SERVICE:PORT`` becomes the local port of the pod behind that Service;
    ``--host 0.0.0.0`` becomes 127.0.0.1; the ConfigMap's [store] table is replaced by the test's
    local store (the real model, signed with the Secret's manifest key); Secrets get test values;
 2. the API server is tests/kubeapi.py's twin: a pod whose spec mounts a service-account token gets
    $KUBECONFIG pointing at it (what the kubelet's token mount does in a cluster), others do not;
 3. start every container (its own process group, log in the run's directory);
 4. kubelet + endpoints controller: poll each startup/readiness probe as declared (httpGet path and
    named or numbered port); a ready pod becomes a ready endpoint of its Service's EndpointSlice; a
    container that exits is a failure with its log's tail;
 5. ``prestop(dep)``: the container's preStop hook (exec or httpGet), remapped, run with the
    container's env; the endpoint turns terminating, as in a cluster;
 6. ``stop()``: SIGTERM to every process group, SIGKILL after the grace period (bounded); no
    process is left (also on failure: the runner is a context manager).

One pod per Deployment at first (``pods[deployment]``). ``reconcile(deployment, limit)`` is one step of
the ReplicaSet controller against the twin's ``spec.replicas`` (which the autoscaler patches): it starts
pods up to it (at most ``limit``) and, above it, deletes pods in the ReplicaSet's order — not ready first,
then the lowest ``controller.kubernetes.io/pod-deletion-cost`` (as patched on the twin), then the newest —
each through its preStop hook, then SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from compute.node.launcher import free_port
from tests import kubeapi

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
IMAGE = "pdserve"  # containers whose image is this one (any registry / tag) are run
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class PodFailed(AssertionError):
    """A container did not start, exited, or never became ready: the manifest names something the code lacks."""


def image_config(dockerfile: Path = ROOT / "deploy" / "Dockerfile") -> tuple[list[str], dict[str, str]]:
    """(ENTRYPOINT, ENV) of the Dockerfile's last stage."""
    text = dockerfile.read_text().replace("\\\n", " ")
    last = text.split("\nFROM ")[-1]
    entry = json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])", last, re.MULTILINE)[1])
    env: dict[str, str] = {}
    for m in re.finditer(r"^ENV\s+(.*)$", last, re.MULTILINE):
        for tok in shlex.split(m[1]):
            k, _, v = tok.partition("=")
            env[k] = v.replace("$PATH", "")
    return entry, env


def with_store(text: str, locations: list[str], k: int, m: int) -> str:
    """The config file with its [store] table (and sub-tables) replaced by a local store of `locations`
    (k data + m parity shards); the file's hmac_key_file is kept. Also used by deploy/podman/play.py."""
    key_file = tomllib.loads(text).get("store", {}).get("hmac_key_file")
    kept, skipping = [], False
    for line in text.splitlines():
        head = re.match(r"^\s*\[([^\]]+)\]", line)
        if head:
            skipping = head[1].strip() == "store" or head[1].strip().startswith("store.")
        if not skipping:
            kept.append(line)
    store = ["[store]", "locations = " + json.dumps(locations), f"k = {k}", f"m = {m}"]
    if key_file is not None:
        store.append(f"hmac_key_file = {json.dumps(key_file)}")
    return "\n".join(store) + "\n\n" + "\n".join(kept) + "\n"


@dataclass
class Pod:
    deployment: str
    spec: dict  # pod template spec
    container: dict
    labels: dict
    dir: Path
    name: str = ""  # the pod's name ({deployment}-{n}): EndpointSlice targetRef, pod patches
    created: float = 0.0  # when the ReplicaSet made it (monotonic)
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port
    port_names: dict[str, int] = field(default_factory=dict)  # name -> containerPort
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local directory
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    ready: bool = False
    log: Path | None = None

    def local_port(self, port) -> int:
        cport = self.port_names.get(port, -1) if isinstance(port, str) else int(port)
        if cport not in self.ports:
            raise PodFailed(f"{self.deployment}: probe or hook names port {port!r}, which no containerPort declares")
        return self.ports[cport]

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class PodRunner:
    """Runs one rendered overlay's pdserve containers (lifecycle in the module docstring)."""

    def __init__(self, docs: list[dict], workdir: Path, store_locations: list[str], secret_values: dict,
                 store_k: int, store_m: int, only: set[str] | None = None):  # fmt: skip
        self.docs = docs
        self.dir = workdir
        self.store_locations = store_locations
        self.store_k, self.store_m = store_k, store_m
        self.secret_values = dict(secret_values)  # (secret, key) -> value; others get random test values
        self.namespace = next((o["metadata"].get("namespace") for o in docs), None) or "default"
        self.config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in docs if o["kind"] == "ConfigMap"}
        self.services = {o["metadata"]["name"]: o for o in docs if o["kind"] == "Service"}
        deps = {o["metadata"]["name"]: o for o in docs if o["kind"] == "Deployment"}
        self.entrypoint, self.image_env = image_config()
        self.pods: dict[str, Pod] = {}  # deployment -> its first pod
        for name, dep in deps.items():
            tpl = dep["spec"]["template"]
            for c in tpl["spec"]["containers"]:
                if c["image"].split("/")[-1].split(":")[0] == IMAGE and (only is None or name in only):
                    self.pods[name] = Pod(name, tpl["spec"], c, tpl["metadata"].get("labels", {}), workdir / name,
                                          f"{name}-0", time.monotonic())  # fmt: skip
        self.all: list[Pod] = list(self.pods.values())  # every pod made, deleted ones included
        self.deleted: list[Pod] = []
        self.api = kubeapi.KubeApiTwin(self.namespace, {n: 1 for n in deps if "replicas" not in deps[n]["spec"]})
        self.kubeconfig = workdir / "kubeconfig"
        self._planned = False
        self._started: set[str] = set()  # pods whose startup probe passed

    # --- 1. plan -------------------------------------------------------------------------------

    def plan(self) -> None:
        for pod in self.pods.values():
            self._ports(pod)
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "twin",
            "clusters": [{"name": "twin", "cluster": {"server": self.api.url}}],
            "users": [{"name": "pod", "user": {"token": "service-account-token"}}],
            "contexts": [{"name": "twin", "context": {"cluster": "twin", "user": "pod", "namespace": self.namespace}}],
        }))  # fmt: skip
        for pod in self.pods.values():
            self._command(pod)

    def _ports(self, pod: Pod) -> None:
        for p in pod.container.get("ports", []):
            pod.ports[p["containerPort"]] = free_port()
            if "name" in p:
                pod.port_names[p["name"]] = p["containerPort"]

    def _command(self, pod: Pod) -> None:
        self._volumes(pod)
        c = pod.container
        cmd = list(c.get("command") or self.entrypoint) + list(c.get("args", []))
        pod.argv = [self._exe(self.remap(pod, a, arg=True)) if i == 0 else self.remap(pod, a, arg=True)
                    for i, a in enumerate(cmd)]  # fmt: skip
        pod.env = self._env(pod)

    def _volumes(self, pod: Pod) -> None:
        vols = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for vm in pod.container.get("volumeMounts", []):
            v = vols.get(vm["name"])
            if v is None:
                raise PodFailed(f"{pod.deployment}: volumeMount {vm['name']!r} names no volume")
            d = pod.dir / "volumes" / vm["name"]
            d.mkdir(parents=True, exist_ok=True)
            pod.mounts[vm["mountPath"]] = d
        for vm in pod.container.get("volumeMounts", []):  # contents after every mount is known (paths remap)
            v, d = vols[vm["name"]], pod.mounts[vm["mountPath"]]
            if "configMap" in v:
                data = self._config_map(v["configMap"]["name"], pod.deployment)
                for key, path in self._items(v["configMap"], data):
                    text = self.remap(pod, data[key])  # then the store: its paths are the host's own
                    if key.endswith(".toml"):  # its hmac_key_file is remapped already
                        text = with_store(text, self.store_locations, self.store_k, self.store_m)
                    (d / path).write_text(text)
            elif "secret" in v:
                name = v["secret"]["secretName"]
                keys = [i["key"] for i in v["secret"].get("items", [])]
                for key, path in self._items(v["secret"], dict.fromkeys(keys)):
                    (d / path).write_text(self.secret(name, key))

    def _items(self, src: dict, data: dict):
        items = src.get("items")
        return [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]

    def _config_map(self, name: str, who: str) -> dict:
        # kustomize's generator suffixes the name; the rendered Deployment refers to the suffixed one
        if name not in self.config_maps:
            raise PodFailed(f"{who}: ConfigMap {name!r} is not in the overlay")
        return self.config_maps[name]

    def secret(self, name: str, key: str) -> str:
        return self.secret_values.setdefault((name, key), f"test-{key}-{secrets.token_hex(8)}")

    def remap(self, pod: Pod, text: str, arg: bool = False) -> str:
        if pod.mounts:  # one pass, whole path prefixes only: /tmp must not rewrite an already-remapped path
            alt = "|".join(re.escape(m) for m in sorted(pod.mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w/.-])({alt})(?=/|\b|$)", lambda m: str(pod.mounts[m[1]]), text)
        for svc_name, svc in self.services.items():
            target = self._service_target(svc)
            for sp in svc["spec"]["ports"]:
                if target is None:
                    continue
                local = target.local_port(sp.get("targetPort", sp["port"]))
                for host in (f"{svc_name}.{self.namespace}.svc.cluster.local", f"{svc_name}.{self.namespace}.svc",
                             f"{svc_name}.{self.namespace}", svc_name):  # fmt: skip
                    text = re.sub(rf"\b{re.escape(host)}:{sp['port']}\b", f"127.0.0.1:{local}", text)
        for cport, local in pod.ports.items():
            text = re.sub(rf"\b(127\.0\.0\.1|localhost):{cport}\b", f"127.0.0.1:{local}", text)
            if arg and text == str(cport):
                text = str(local)
        if arg and text in ("0.0.0.0", "::"):
            text = "127.0.0.1"  # loopback only
        return text

    def _service_target(self, svc: dict) -> Pod | None:
        sel = svc["spec"].get("selector", {})
        for pod in self.pods.values():
            if sel and sel.items() <= pod.labels.items():
                return pod
        return None

    def _exe(self, name: str) -> str:
        if "/" in name:
            return name
        found = VENV_BIN / name
        if not found.exists():
            raise PodFailed(f"command {name!r} is not installed (not in {VENV_BIN})")
        return str(found)

    def _env(self, pod: Pod) -> dict[str, str]:
        env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(pod.dir), "LANG": "C.UTF-8",
               "TMPDIR": str(pod.mounts.get("/tmp", pod.dir))}  # fmt: skip
        for k, v in self.image_env.items():
            env[k] = self.remap(pod, v) if k != "PATH" else env["PATH"]
        for e in pod.container.get("env", []):
            if "value" in e:
                env[e["name"]] = self.remap(pod, str(e["value"]))
                continue
            ref = e["valueFrom"]
            if "secretKeyRef" in ref:
                env[e["name"]] = self.secret(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            elif "configMapKeyRef" in ref:
                data = self._config_map(ref["configMapKeyRef"]["name"], pod.deployment)
                env[e["name"]] = self.remap(pod, data[ref["configMapKeyRef"]["key"]])
            elif "fieldRef" in ref:
                env[e["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": pod.name,
                                  "metadata.namespace": self.namespace}[ref["fieldRef"]["fieldPath"]]  # fmt: skip
            else:
                raise PodFailed(f"{pod.deployment}: env {e['name']}: unsupported valueFrom {ref}")
        for src in pod.container.get("envFrom", []):
            if "configMapRef" in src:
                env.update({k: self.remap(pod, v) for k, v in self._config_map(src["configMapRef"]["name"],
                                                                                pod.deployment).items()})  # fmt: skip
        if pod.spec.get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self.kubeconfig)  # stands in for the kubelet's token mount
        return env

    # --- 3.-4. start, probe ---------------------------------------------------------------------

    def start(self, only: set[str] | None = None) -> None:
        """Start the pods of these Deployments (default: every one not started yet); pods start in any order
        in a cluster, so a test may start some, look at them, then the rest."""
        if not self._planned:
            self.plan()
            self._planned = True
        for pod in self.pods.values():
            if pod.proc is None and (only is None or pod.deployment in only):
                self._launch(pod)

    def _launch(self, pod: Pod) -> None:
        pod.dir.mkdir(parents=True, exist_ok=True)
        pod.log = pod.dir / "container.log"
        with open(pod.log, "wb") as log:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=pod.dir, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def probe(self, pod: Pod, kind: str) -> bool:
        pr = pod.container.get(kind)
        if pr is None:
            return True
        if "httpGet" not in pr:
            raise PodFailed(f"{pod.deployment}: {kind} is not httpGet (the runner polls httpGet probes only)")
        g = pr["httpGet"]
        try:
            r = httpx.get(f"http://127.0.0.1:{pod.local_port(g['port'])}{g.get('path', '/')}", timeout=2.0)
            return 200 <= r.status_code < 400
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Poll every probe until each started pod is ready (startup, then readiness); -> seconds it took."""
        t0 = time.monotonic()
        while True:
            self.probe_pass()
            if all(p.ready for p in self.started()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                late = [p for p in self.started() if not p.ready]
                logs = "\n".join(f"--- {p.deployment}\n{p.log_tail()}" for p in late)
                raise PodFailed(f"not ready after {timeout_s:.0f} s: {', '.join(p.deployment for p in late)}\n{logs}")
            time.sleep(0.25)

    def probe_pass(self) -> None:
        """The kubelet, once: every started pod's startup, then readiness probe; a ready pod becomes a ready
        endpoint; a container that exited is a failure."""
        for pod in self.started():
            rc = pod.proc.poll()
            if rc is not None:
                raise PodFailed(f"{pod.name}: container exited with {rc}\n"
                                f"  argv: {shlex.join(pod.argv)}\n{pod.log_tail()}")  # fmt: skip
            if pod.ready:
                continue
            if pod.name not in self._started and self.probe(pod, "startupProbe"):
                self._started.add(pod.name)
            if pod.name in self._started and self.probe(pod, "readinessProbe"):
                pod.ready = True
                self._endpoint(pod, ready=True)

    def started(self) -> list[Pod]:
        """The pods running (started, not deleted)."""
        return [p for p in self.all if p.proc is not None and p not in self.deleted]

    # --- the ReplicaSet controller ----------------------------------------------------------------

    def replicas_of(self, deployment: str) -> list[Pod]:
        return [p for p in self.started() if p.deployment == deployment]

    def reconcile(self, deployment: str, limit: int) -> None:
        """One step: start pods up to the twin's spec.replicas (at most `limit` running), or delete the surplus
        in the ReplicaSet's order (the module docstring); then one probe pass."""
        want = min(self.api.replicas[deployment], limit)
        mine = self.replicas_of(deployment)
        first = self.pods[deployment]
        for n in range(len(mine), want):
            i = len([p for p in self.all if p.deployment == deployment])
            pod = Pod(deployment, first.spec, first.container, first.labels, self.dir / f"{deployment}-{i}",
                      f"{deployment}-{i}", time.monotonic())  # fmt: skip
            self._ports(pod)
            self._command(pod)
            self.all.append(pod)
            self._launch(pod)
        if len(mine) > want:
            notes = self.api.annotations
            order = sorted(mine, key=lambda p: (p.ready, int(notes.get(p.name, {}).get(DELETION_COST, 0)),
                                                -p.created))  # fmt: skip
            for pod in order[: len(mine) - want]:
                self.delete(pod)
        self.probe_pass()

    def delete(self, pod: Pod) -> None:
        """A pod deleted: its endpoint terminating, its preStop hook, SIGTERM (SIGKILL after the grace period),
        then its endpoints gone."""
        hook = self._prestop(pod)
        if isinstance(hook, subprocess.CompletedProcess) and hook.returncode != 0:
            raise PodFailed(f"{pod.name}: preStop failed: {hook.stderr[-1000:]}")
        _signal_group(pod.proc, signal.SIGTERM)
        try:
            pod.proc.wait(pod.spec.get("terminationGracePeriodSeconds", 30))
        except subprocess.TimeoutExpired:
            _signal_group(pod.proc, signal.SIGKILL)
            pod.proc.wait(10)
        _signal_group(pod.proc, signal.SIGKILL)  # nothing of the group outlives it
        self.deleted.append(pod)
        for name in self._services_of(pod):
            self.api.delete_slice(f"{name}-{pod.name}")

    def _services_of(self, pod: Pod) -> list[str]:
        return [name for name, svc in self.services.items()
                if (sel := svc["spec"].get("selector", {})) and sel.items() <= pod.labels.items()]  # fmt: skip

    def _endpoint(self, pod: Pod, ready: bool, terminating: bool = False) -> None:
        """The endpoints controller: one EndpointSlice per (Service, pod) — each pod has its own port here."""
        for name in self._services_of(pod):
            port = self.services[name]["spec"]["ports"][0]
            local = pod.local_port(port.get("targetPort", port["port"]))
            sl = kubeapi.endpoint_slice(name, pod.name, [("127.0.0.1", ready, terminating, pod.name)],
                                        self.namespace, port=local)  # fmt: skip
            sl["ports"] = [{"name": port.get("name", "http"), "port": local, "protocol": "TCP"}]
            self.api.put_slice(sl)

    # --- 5. preStop -----------------------------------------------------------------------------

    def prestop(self, deployment: str) -> subprocess.CompletedProcess | httpx.Response:
        """The first pod of the Deployment's preStop hook (the pod is Terminating; it is not stopped here)."""
        return self._prestop(self.pods[deployment])

    def _prestop(self, pod: Pod) -> subprocess.CompletedProcess | httpx.Response:
        self._endpoint(pod, ready=False, terminating=True)  # the pod is Terminating: its endpoint says so
        hook = pod.container.get("lifecycle", {}).get("preStop")
        if hook is None:
            raise PodFailed(f"{pod.deployment}: no preStop hook")
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        if "exec" in hook:
            cmd = [self.remap(pod, a) for a in hook["exec"]["command"]]
            cmd[0] = self._exe(cmd[0]) if cmd[0] in ("python", "python3", "pdserve") else cmd[0]
            return subprocess.run(cmd, env=pod.env, cwd=pod.dir, capture_output=True, text=True, timeout=grace,
                                  check=False)  # fmt: skip
        g = hook["httpGet"]
        return httpx.get(f"http://127.0.0.1:{pod.local_port(g['port'])}{g.get('path', '/')}", timeout=grace)

    # --- 6. stop --------------------------------------------------------------------------------

    def stop(self, grace_s: float = 20.0) -> list[str]:
        """SIGTERM every container, SIGKILL what is left after grace_s; -> names that needed SIGKILL."""
        live = [p for p in self.all if p.proc is not None and p.proc.poll() is None]
        for p in live:
            _signal_group(p.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        killed = []
        for p in live:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(p.name)
                _signal_group(p.proc, signal.SIGKILL)
                p.proc.wait(10)
        for p in self.all:  # nothing of the group may outlive its container
            if p.proc is not None:
                _signal_group(p.proc, signal.SIGKILL)
        self.api.close()
        return killed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
