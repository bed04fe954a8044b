"""Prometheus for the tests: a server on 127.0.0.1 (Debian's `prometheus` package, its own config and TSDB in
a temporary directory), and the scrape job the Prometheus Operator would generate from a ServiceMonitor.

Lifecycle of a scrape as tests/deploy/test_observability.py runs it:
 1. ``discovered``: each local process stands for the endpoints of a rendered Service — a static target
    carrying the meta labels Kubernetes service discovery would give it (the Service's labels, name and
    namespace, the pod name, the port name);
 2. ``scrape_job``: the operator's relabelings (keep the Services the ServiceMonitor selects and its port;
    namespace, service, pod, job, endpoint labels), then the endpoint's own path, scheme, credentials and
    relabelings, translated key by key (an unknown key fails: the test must learn it);
 3. ``Prometheus``: started with that job, polled until ready (bounded), queried through its HTTP API,
    stopped (SIGTERM, SIGKILL after 15 s) by the fixture that started it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from compute.node.launcher import free_port
from tests.services import wait_for


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: install Debian's prometheus package (apt-get install -y prometheus)")
    return path


def _sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def discovered(service: dict, address: str, pod: str) -> list[dict]:
    """One target per port of `service`, with the meta labels Kubernetes SD (role endpoints) gives it."""
    meta = {"__meta_kubernetes_namespace": service["metadata"]["namespace"],
            "__meta_kubernetes_service_name": service["metadata"]["name"], "__meta_kubernetes_pod_name": pod}  # fmt: skip
    for k, v in service["metadata"].get("labels", {}).items():
        meta[f"__meta_kubernetes_service_label_{_sanitize(k)}"] = v
        meta[f"__meta_kubernetes_service_labelpresent_{_sanitize(k)}"] = "true"
    return [{"targets": [address], "labels": meta | {"__meta_kubernetes_endpoint_port_name": p["name"]}}
            for p in service["spec"]["ports"]]  # fmt: skip


def _relabel(r: dict) -> dict:
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex", "action": "action",
            "replacement": "replacement", "separator": "separator", "modulus": "modulus"}  # fmt: skip
    unknown = set(r) - set(keys)
    assert not unknown, f"relabeling keys tests/deploy/prometheus.py does not translate yet: {unknown}"
    out = {keys[k]: v for k, v in r.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def scrape_job(sm: dict, targets: list[dict], interval_s: float, secrets: dict[tuple[str, str], str],
               secrets_dir: Path) -> dict:  # fmt: skip
    """The scrape job the Prometheus Operator generates for the ServiceMonitor's (only) endpoint, over
    `targets` given statically: its selector and port kept, namespace/service/pod/job/endpoint labels, the
    endpoint's path, scheme, credentials (a Secret key's value from `secrets`, {(Secret, key): value}) and
    relabelings; the interval `interval_s` (a test's, shorter than the manifest's)."""
    (ep,) = sm["spec"]["endpoints"]
    known = {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
             "authorization", "bearerTokenSecret", "honorLabels"}  # fmt: skip
    assert not set(ep) - known, f"ServiceMonitor endpoint keys tests/deploy/prometheus.py does not translate yet: {set(ep) - known}"
    relabel = [{"source_labels": [f"__meta_kubernetes_service_label_{_sanitize(k)}",
                                  f"__meta_kubernetes_service_labelpresent_{_sanitize(k)}"],
                "regex": f"({re.escape(v)});true", "action": "keep"}
               for k, v in sm["spec"]["selector"]["matchLabels"].items()]  # fmt: skip
    relabel += [
        {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": ep["port"], "action": "keep"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        {"target_label": "endpoint", "replacement": ep["port"]},
    ]
    relabel += [_relabel(r) for r in ep.get("relabelings", [])]
    name = f"serviceMonitor/{sm['metadata'].get('namespace', 'default')}/{sm['metadata']['name']}/0"
    job = {"job_name": name, "scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s", "metrics_path": ep.get("path", "/metrics"),
           "scheme": ep.get("scheme", "http"), "honor_labels": ep.get("honorLabels", False),
           "static_configs": targets, "relabel_configs": relabel,
           "metric_relabel_configs": [_relabel(r) for r in ep.get("metricRelabelings", [])]}  # fmt: skip
    ref = (ep.get("authorization") or {}).get("credentials") or ep.get("bearerTokenSecret")
    if ref:  # a Secret key: the value the pods get from the same key
        (secrets_dir / "token").write_text(secrets[ref["name"], ref["key"]])
        kind = (ep.get("authorization") or {}).get("type", "Bearer")
        job["authorization"] = {"type": kind, "credentials_file": str(secrets_dir / "token")}
    return job


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own config and TSDB under `tmp`, stopped by `stop`."""

    def __init__(self, tmp: Path, config: dict):
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed by stop()
        self.p = subprocess.Popen([binary("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)  # fmt: skip
        self.log_path = tmp / "prometheus.log"

    def wait_ready(self, timeout: float = 60) -> Prometheus:
        def ready():
            assert self.p.poll() is None, self.log_path.read_text()[-3000:]
            try:
                return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout, "Prometheus ready", every=0.2)
        return self

    def api(self, path: str, **params) -> dict | list:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.log.close()
