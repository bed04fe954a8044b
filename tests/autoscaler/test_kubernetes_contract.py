"""Contract test of KubernetesActuator against a stand-in API server.

No cluster runs here. The server below (stdlib http.server on 127.0.0.1, port 0)
implements exactly the calls the actuator is allowed to make — the ones the RBAC Role
in deploy/base grants — and answers anything else with 404, so the test pins the
requests sent (method, path, query, content type, body) and the parsing of answers:

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (JSON merge patch)
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name=...
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")

from autoscaler import AutoscalerConfig, Backoff, ControlLoop, NodeInfo, RoleLoad
from autoscaler.actuator import PermanentActuatorError, TemporaryActuatorError
from autoscaler.kubernetes import KubernetesActuator, KubernetesConfig

NS = "pdserve-test"
SCALE = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")
SLICES = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/endpointslices$")


def endpoint_slice(service: str, suffix: str, endpoints: list[tuple[str, bool | None, bool, str]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{service}-{suffix}", "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "metrics", "port": 9100, "protocol": "TCP"},
                  {"name": "http", "port": 8001, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": term},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}}
                      for ip, ready, term, pod in endpoints],
    }  # fmt: skip


class FakeApiServer:
    """The API surface the actuator uses, recording every request; `faults` answers the next matching ones."""

    def __init__(self):
        self.requests: list[dict] = []
        self.faults: list[tuple[str, int]] = []  # (method, status) answered first, in order
        self.replicas = {"pdserve-prefill": 1, "pdserve-decode": 2}
        self.slices = [
            endpoint_slice("pdserve-prefill", "abcde", [("10.0.0.5", True, False, "pdserve-prefill-1"),
                                                        ("10.0.0.6", False, False, "pdserve-prefill-2")]),
            endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", True, False, "pdserve-decode-1"),
                                                       ("10.0.1.8", None, False, "pdserve-decode-2"),
                                                       ("10.0.1.9", False, True, "pdserve-decode-3")]),
        ]  # fmt: skip
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                server._handle(self, "GET")

            def do_PATCH(self):
                server._handle(self, "PATCH")

            def do_PUT(self):
                server._handle(self, "PUT")

            def do_POST(self):
                server._handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def _reply(self, h, status: int, obj: dict):
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _scale(self, name: str) -> dict:
        n = self.replicas[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": f"app={name}"}}  # fmt: skip

    def _handle(self, h, method: str):
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        self.requests.append({"method": method, "path": parts.path, "query": parse_qs(parts.query),
                              "content_type": h.headers.get("Content-Type"),
                              "body": json.loads(raw) if raw else None})  # fmt: skip
        for i, (m, status) in enumerate(self.faults):
            if m == method:
                del self.faults[i]
                reason = {409: "Conflict", 500: "InternalError", 403: "Forbidden"}.get(status, "Error")
                return self._reply(h, status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                               "reason": reason, "code": status})  # fmt: skip
        if (m := SCALE.match(parts.path)) and m["ns"] == NS and m["name"] in self.replicas:
            if method == "GET":
                return self._reply(h, 200, self._scale(m["name"]))
            if method == "PATCH" and h.headers.get("Content-Type") == "application/merge-patch+json":
                self.replicas[m["name"]] = int(json.loads(raw)["spec"]["replicas"])
                return self._reply(h, 200, self._scale(m["name"]))
            return self._reply(h, 415, {"kind": "Status", "code": 415})
        if (m := SLICES.match(parts.path)) and m["ns"] == NS and method == "GET":
            sel = parse_qs(parts.query).get("labelSelector", [""])[0]
            key, _, value = sel.partition("=")
            items = [s for s in self.slices if key == "kubernetes.io/service-name"
                     and s["metadata"]["labels"][key] == value]  # fmt: skip
            return self._reply(h, 200, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                        "metadata": {"resourceVersion": "42"}, "items": items})  # fmt: skip
        return self._reply(h, 404, {"kind": "Status", "code": 404, "reason": "NotFound"})


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def actuator(api):
    sleeps: list[float] = []
    conf = kubernetes.client.Configuration(host=api.url)
    act = KubernetesActuator(KubernetesConfig(namespace=NS), configuration=conf, sleep=sleeps.append)
    act.sleeps = sleeps
    yield act
    act.close()


def only(api, method=None):
    return [(r["method"], r["path"]) for r in api.requests if method is None or r["method"] == method]


def test_contract_read_replicas_through_the_scale_subresource(api, actuator):
    assert actuator.replicas("decode") == 2
    assert only(api) == [("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale")]


def test_contract_scale_sends_a_merge_patch_of_spec_replicas(api, actuator):
    actuator.scale("prefill", 5)
    (req,) = api.requests
    assert (req["method"], req["path"]) == ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-prefill/scale")
    assert req["content_type"] == "application/merge-patch+json"
    assert req["body"] == {"spec": {"replicas": 5}}
    assert req["query"] == {"fieldManager": ["pdserve-autoscaler"]}
    assert api.replicas["pdserve-prefill"] == 5 and actuator.replicas("prefill") == 5


def test_contract_nodes_from_endpointslices(api, actuator):
    nodes = actuator.current()
    assert [(r["method"], r["path"], r["query"]) for r in api.requests] == [
        ("GET", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
         {"labelSelector": ["kubernetes.io/service-name=pdserve-prefill"]}),
        ("GET", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
         {"labelSelector": ["kubernetes.io/service-name=pdserve-decode"]}),
    ]  # fmt: skip
    assert nodes["prefill"] == [
        NodeInfo("prefill", "http://10.0.0.5:8001", True, "pdserve-prefill-1", "ready"),
        NodeInfo("prefill", "http://10.0.0.6:8001", False, "pdserve-prefill-2", "loading"),
    ]
    assert nodes["decode"] == [
        NodeInfo("decode", "http://10.0.1.7:8001", True, "pdserve-decode-1", "ready"),
        NodeInfo("decode", "http://10.0.1.8:8001", True, "pdserve-decode-2", "ready"),  # ready unset = ready
        NodeInfo("decode", "http://10.0.1.9:8001", False, "pdserve-decode-3", "draining"),  # terminating
    ]
    assert ("prefill", "http://10.0.0.6:8001", False) in actuator.endpoints()


def test_contract_500_and_409_are_retried_with_exponential_backoff(api, actuator):
    api.faults = [("PATCH", 500), ("PATCH", 409)]
    actuator.scale("decode", 3)
    assert only(api) == [("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale")] * 3
    assert actuator.sleeps == [0.2, 0.4]
    assert api.replicas["pdserve-decode"] == 3


def test_contract_persistent_500_becomes_a_temporary_error_after_all_tries(api, actuator):
    api.faults = [("GET", 500)] * 4
    with pytest.raises(TemporaryActuatorError, match=r"HTTP 500 .*after 4 tries"):
        actuator.replicas("prefill")
    assert len(api.requests) == 4 and actuator.sleeps == [0.2, 0.4, 0.8]


def test_contract_403_is_permanent_and_not_retried(api, actuator):
    api.faults = [("PATCH", 403)]
    with pytest.raises(PermanentActuatorError, match="HTTP 403"):
        actuator.scale("prefill", 2)
    assert len(api.requests) == 1 and actuator.sleeps == []


def test_contract_unreachable_api_is_temporary(api):
    api.close()
    conf = kubernetes.client.Configuration(host=api.url)
    conf.retries = False
    act = KubernetesActuator(
        KubernetesConfig(namespace=NS, attempts=2, backoff=Backoff(base_s=0.0)), configuration=conf
    )
    with pytest.raises(TemporaryActuatorError):
        act.scale("prefill", 2)


def test_contract_the_loop_drives_the_deployments_and_survives_api_errors(api, actuator):
    t = [0.0]
    clock = lambda: t[0]
    load = {"prefill": RoleLoad(queued_prompt_tokens=30_000, queue_depth=20), "decode": RoleLoad(running_streams=10)}
    loop = ControlLoop(AutoscalerConfig(target_queued_prompt_tokens_per_replica=1000), lambda: load, actuator,
                       clock=clock, backoff=Backoff(base_s=1.0))  # fmt: skip
    api.faults = [("PATCH", 500)] * 4  # one tick's worth of tries, all failing
    report = loop.tick()
    assert report.error.startswith("TemporaryActuatorError") and report.failures == 1
    for _ in range(3):
        t[0] += 1.0
        report = loop.tick()
    assert report.error == "" and api.replicas["pdserve-prefill"] == 8  # panic sizing, capped at prefill_max 8
    assert api.replicas["pdserve-decode"] == 2  # decode load fits: untouched
    assert {p for m, p in only(api)} <= {
        f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-prefill/scale",
        f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale",
        f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
    }
