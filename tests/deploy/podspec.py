"""A pod of a rendered overlay, planned as a local process: what tests/deploy/pods.py's runner starts.

``Pod`` is one pod of a Deployment (its template spec, container, labels, directory) and, once planned,
what runs it here: containerPort -> local port, mountPath -> local directory, argv, env. ``PodPlanner``
(a base of ``PodRunner``) plans a pod in this order:
 1. ports: every containerPort gets a free local port (named ports kept by name);
 2. volumes: one directory per volumeMount under the pod's directory; then their contents —
    configMap keys and Secret items as files (a *.toml key gets ``with_store``'s local [store]),
    Secrets with the runner's test values;
 3. command: the container's command (else the image's ENTRYPOINT, from deploy/Dockerfile) and args,
    each remapped (``remap``: mountPaths -> their directories, ``SERVICE[.NS[.svc[.cluster.local]]]:PORT``
    -> the local port of the pod behind that Service, the pod's own ports, ``0.0.0.0`` -> 127.0.0.1);
    the executable is the venv's;
 4. env: the image's ENV, then the container's env (value, secretKeyRef, configMapKeyRef, fieldRef)
    and envFrom configMapRef, remapped; $KUBECONFIG (the API twin) unless the pod opts out of the
    service-account token.
Anything the manifest names that the overlay or the image lacks is a ``PodFailed``.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from compute.node.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


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


class PodPlanner:
    """Plans pods (the module docstring): the plan half of ``PodRunner``, which sets what it reads —
    ``pods``, ``services``, ``config_maps``, ``namespace``, ``secret_values``, ``store_locations``,
    ``store_k`` / ``store_m``, ``entrypoint``, ``image_env`` and ``kubeconfig``."""

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
            if "value" in e:  # $(NAME) of a variable defined above expands, as the kubelet expands it
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(e["value"]))
                env[e["name"]] = self.remap(pod, value)
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
