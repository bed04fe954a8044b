"""The pod runner: a rendered overlay's pdserve containers run as local processes, as a kubelet would.

No cluster, no image: each container of the pdserve image runs its exact command line, with the
image's ENTRYPOINT and ENV (read from deploy/Dockerfile) and the manifest's args and env, on loopback.

Lifecycle of one run (``PodRunner``):
 1. plan (tests/deploy/podspec.py): one pod per Deployment; every containerPort gets a free local
    port; volumes are materialised under the run's directory (configMap keys and Secret items as
    files, emptyDir as directories) and every path under a mountPath is remapped there — in args,
    env values and the mounted files; ``http://SERVICE:PORT`` becomes the local port of the pod
    behind that Service; ``--host 0.0.0.0`` becomes 127.0.0.1; the ConfigMap's [store] table is
    replaced by the test's local store (the real model, signed with the Secret's manifest key);
    Secrets get test values;
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
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Self

import httpx

from tests import kubeapi
from tests.deploy.podspec import (  # noqa: F401 - ROOT, image_config, with_store: re-exported (tests, deploy/podman/play.py)
    ROOT,
    Pod,
    PodFailed,
    PodPlanner,
    image_config,
    with_store,
)

IMAGE = "pdserve"  # containers whose image is this one (any registry / tag) are run
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class PodRunner(PodPlanner):
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
        """Every pod's ports, then the twin's kubeconfig, then every pod's volumes, command and env
        (PodPlanner, tests/deploy/podspec.py: commands need every Service's local port)."""
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
