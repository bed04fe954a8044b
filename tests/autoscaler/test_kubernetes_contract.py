"""Contract test of KubernetesActuator against a stand-in API server.

No cluster runs here. The server below (stdlib http.server on 127.0.0.1, port 0)
implements exactly the calls the actuator is allowed to make — the ones the RBAC Role
in deploy/base grants — and answers anything else with 404, so the test pins the
requests sent (method, path, query, content type, body) and the parsing of answers:

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (JSON merge patch)
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name=...

and the gateway's node registry source (gateway/discovery.py), which lists and then watches the
same EndpointSlices (list + watch: what the gateway's Role in deploy/base grants):

  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...&watch=true&resourceVersion=...
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
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
        self.rv = 42  # resourceVersion of the EndpointSlice collection, bumped by every change
        self.events: list[tuple[int, str, dict]] = []  # (rv, ADDED|MODIFIED|DELETED, slice) for watches
        self.cond = threading.Condition()
        self.closing = False
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
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def put_slice(self, sl: dict) -> None:
        """Create or replace an EndpointSlice, as the endpoints controller does; watchers see the event."""
        with self.cond:
            self.rv += 1
            name = sl["metadata"]["name"]
            kind = "MODIFIED" if any(x["metadata"]["name"] == name for x in self.slices) else "ADDED"
            self.slices = [x for x in self.slices if x["metadata"]["name"] != name] + [sl]
            self.events.append((self.rv, kind, sl))
            self.cond.notify_all()

    def delete_slice(self, name: str) -> None:
        with self.cond:
            self.rv += 1
            (sl,) = [x for x in self.slices if x["metadata"]["name"] == name]
            self.slices.remove(sl)
            self.events.append((self.rv, "DELETED", sl))
            self.cond.notify_all()

    def _watch(self, h, selector: tuple[str, str], since: int, timeout_s: float) -> None:
        """A WATCH: newline-delimited JSON events after `since` for matching slices, until timeoutSeconds,
        one HTTP/1.1 chunk per event (as the API server streams them; the client reads chunk by chunk)."""
        h.protocol_version = "HTTP/1.1"
        h.close_connection = True
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        try:
            self._stream_events(h, selector, since, timeout_s)
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    def _stream_events(self, h, selector: tuple[str, str], since: int, timeout_s: float) -> None:
        deadline = time.monotonic() + min(timeout_s, 30.0)
        sent = since
        while True:
            with self.cond:
                while not self.closing and time.monotonic() < deadline and not any(rv > sent for rv, *_ in self.events):
                    self.cond.wait(max(0.0, min(0.2, deadline - time.monotonic())))
                if self.closing or time.monotonic() >= deadline:
                    return
                batch = [e for e in self.events if e[0] > sent]
            for rv, kind, sl in batch:
                sent = rv
                if sl["metadata"]["labels"].get(selector[0]) != selector[1]:
                    continue
                obj = {**sl, "metadata": {**sl["metadata"], "resourceVersion": str(rv)}}
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                h.wfile.flush()

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
            q = parse_qs(parts.query)
            sel = q.get("labelSelector", [""])[0]
            key, _, value = sel.partition("=")
            if q.get("watch", [""])[0].lower() == "true":
                since = int(q.get("resourceVersion", ["0"])[0] or 0)
                return self._watch(h, (key, value), since, float(q.get("timeoutSeconds", ["30"])[0]))
            items = [s for s in self.slices if key == "kubernetes.io/service-name"
                     and s["metadata"]["labels"][key] == value]  # fmt: skip
            return self._reply(h, 200, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                        "metadata": {"resourceVersion": str(self.rv)}, "items": items})  # fmt: skip
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


# --- the gateway's node registry source: EndpointSlices listed, then watched -----------------------------

from gateway.discovery import DiscoveryConfig, KubernetesSource  # noqa: E402
from gateway.registry import NodeRegistry  # noqa: E402


async def _until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def _registry_state(reg: NodeRegistry) -> dict[str, tuple[str, bool, str]]:
    return {u: (n.role, n.draining, n.source) for u, n in reg.nodes.items()}


def _source(api, **kw) -> tuple[NodeRegistry, KubernetesSource]:
    reg = NodeRegistry({})
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=api.url))
    cfg = DiscoveryConfig(mode="kubernetes", namespace=NS, watch_timeout_s=kw.pop("watch_timeout_s", 30),
                          backoff_s=0.05, backoff_max_s=0.2, **kw)  # fmt: skip
    return reg, KubernetesSource(cfg, reg, api_client=client)


def test_contract_gateway_registry_lists_then_watches_endpointslices_per_role(api):
    async def run():
        reg, src = _source(api)
        await src.start()
        try:
            await _until(lambda: len(reg.nodes) == 5, "the listed endpoints")
            assert _registry_state(reg) == {
                "http://10.0.0.5:8001": ("prefill", False, "kubernetes"),
                "http://10.0.0.6:8001": ("prefill", False, "kubernetes"),  # loading: known, routed once /load says so
                "http://10.0.1.7:8001": ("decode", False, "kubernetes"),
                "http://10.0.1.8:8001": ("decode", False, "kubernetes"),
                "http://10.0.1.9:8001": ("decode", True, "kubernetes"),  # terminating: never routed to
            }
            await _until(lambda: sum(r["query"].get("watch") == ["true"] for r in api.requests) == 2, "two watches")
            # scale-down of decode-1 (terminating), decode-3 gone, a new decode pod, and a second prefill slice
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", False, True, "pdserve-decode-1"),
                                                                     ("10.0.1.8", True, False, "pdserve-decode-2"),
                                                                     ("10.0.1.10", False, False, "pdserve-decode-4")]))
            api.put_slice(endpoint_slice("pdserve-prefill", "zzzzz", [("10.0.0.11", True, False, "pdserve-prefill-3")]))
            await _until(lambda: "http://10.0.1.10:8001" in reg.nodes and "http://10.0.0.11:8001" in reg.nodes
                         and "http://10.0.1.9:8001" not in reg.nodes, "the watched changes")  # fmt: skip
            assert reg.nodes["http://10.0.1.7:8001"].draining and not reg.nodes["http://10.0.1.8:8001"].draining
            assert reg.nodes["http://10.0.0.11:8001"].role == "prefill"
            api.delete_slice("pdserve-prefill-abcde")
            await _until(lambda: "http://10.0.0.5:8001" not in reg.nodes, "the deleted slice's endpoints")
            assert {u for u, n in reg.nodes.items() if n.role == "prefill"} == {"http://10.0.0.11:8001"}
            reg.add("http://127.0.0.1:9", "decode", "admin")  # another source's node: not this source's to remove
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", []))
            await _until(lambda: not any(n.role == "decode" and n.source == "kubernetes" for n in reg.nodes.values()),
                         "the emptied decode slice")  # fmt: skip
            assert "http://127.0.0.1:9" in reg.nodes
        finally:
            t0 = time.monotonic()
            await src.stop()
            stop_s = time.monotonic() - t0
        assert stop_s < 5.0, f"stop() took {stop_s:.1f} s with two open watches"
        slices = [r for r in api.requests if SLICES.match(r["path"])]
        assert {r["method"] for r in api.requests} == {"GET"}  # list and watch only: nothing to write
        lists = [r["query"]["labelSelector"] for r in slices if "watch" not in r["query"]]
        assert sorted(lists) == [["kubernetes.io/service-name=pdserve-decode"],
                                 ["kubernetes.io/service-name=pdserve-prefill"]]  # fmt: skip
        watches = [r["query"] for r in slices if r["query"].get("watch") == ["true"]]
        assert all(w["resourceVersion"] == ["42"] for w in watches)  # from the list's resourceVersion

    asyncio.run(run())


def test_contract_gateway_source_relists_after_a_watch_ends_or_fails(api):
    async def run():
        reg, src = _source(api, watch_timeout_s=1, services={"decode": "pdserve-decode"})
        api.faults = [("GET", 500)]  # the first list fails: logged, retried after a backoff
        await src.start()
        try:
            await _until(lambda: len(reg.nodes) == 3, "the decode endpoints after the failed list")
            # the 1 s watch ends; the source re-lists and watches again (a change made meanwhile is seen)
            await _until(lambda: sum(r["query"].get("watch") == ["true"] for r in api.requests) >= 2, "a second watch")
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", [("10.0.1.20", True, False, "pdserve-decode-9")]))
            await _until(lambda: set(reg.nodes) == {"http://10.0.1.20:8001"}, "the change after a re-list")
        finally:
            await src.stop()
        statuses = [r for r in api.requests if SLICES.match(r["path"]) and "watch" not in r["query"]]
        assert len(statuses) >= 3  # failed list, first list, re-list

    asyncio.run(run())


def test_gateway_discovery_mode_auto_means_kubernetes_only_inside_a_pod():
    assert DiscoveryConfig().resolved_mode({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == "kubernetes"
    assert DiscoveryConfig().resolved_mode({}) == "static"
    assert DiscoveryConfig(mode="kubernetes").resolved_mode({}) == "kubernetes"
    with pytest.raises(ValueError, match="invalid gateway discovery mode"):
        DiscoveryConfig(mode="dns")
