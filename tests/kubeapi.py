"""A stand-in Kubernetes API server (a twin of kube-apiserver, for tests: no cluster runs here).

stdlib http.server on 127.0.0.1 (port 0), serving exactly the calls pdserve makes — the ones the RBAC
Roles in deploy/base grant — and 404 for anything else, recording every request (method, path, query,
content type, body):

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          (autoscaler: replicas)
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          (autoscaler: JSON merge patch)
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name=S
        [&watch=true&resourceVersion=RV&timeoutSeconds=T]               (autoscaler: list; gateway: list + watch)
  PATCH /api/v1/namespaces/{ns}/pods/{name}                             (autoscaler: JSON merge patch of the
        pod's metadata.annotations — the pod-deletion-cost; a pod exists while an EndpointSlice names it; the
        patch is applied to the whole pod (RFC 7386) and, given ``admission``, admitted by it first: 403 with
        its message, as kube-apiserver answers a ValidatingAdmissionPolicy's Deny)

``put_slice`` / ``delete_slice`` change EndpointSlices as the endpoints controller would (watchers get
ADDED / MODIFIED / DELETED events, one HTTP/1.1 chunk each); ``faults`` answers the next requests of a
method (and path) with an error status. Used by tests/autoscaler/test_kubernetes_{contract,rbac}.py,
tests/gateway/routing/test_kubernetes_source.py and the pod runner.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SCALE = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")
SLICES = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/endpointslices$")
PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$")


def endpoint_slice(service: str, suffix: str, endpoints: list[tuple[str, bool | None, bool, str]], ns: str,
                   port: int = 8001) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{service}-{suffix}", "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "metrics", "port": 9100, "protocol": "TCP"},
                  {"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": term},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}
                      for ip, ready, term, pod in endpoints],
    }  # fmt: skip


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: objects merge key by key, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    target = target if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = merge_patch(target.get(k), v)
    return target


class KubeApiTwin:
    """The API surface pdserve uses, recording every request; `faults` answers the next matching ones."""

    def __init__(self, namespace: str, replicas: dict[str, int] | None = None, slices: list[dict] | None = None,
                 admission=None):  # fmt: skip
        """``admission(old_pod, new_pod)`` -> a denial's message or None (tests/admission.py ``Policy``)."""
        self.namespace, self.admission = namespace, admission
        self.pods: dict[str, dict] = {}  # pod -> the object as patched (made when first patched)
        self.requests: list[dict] = []
        self.faults: list[tuple] = []  # (method, status[, path part]) answered first, in order
        self.rv = 42  # resourceVersion of the EndpointSlice collection, bumped by every change
        self.events: list[tuple[int, str, dict]] = []  # (rv, ADDED|MODIFIED|DELETED, slice) for watches
        self.cond = threading.Condition()
        self.closing = False
        self.replicas = dict(replicas or {})  # Deployment -> spec.replicas
        self.slices = list(slices or [])
        self.annotations: dict[str, dict[str, str]] = {}  # pod -> metadata.annotations, as patched
        self.open_watches = 0  # WATCH responses still streaming (ended by their timeoutSeconds, or by close())
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

    def pod_names(self) -> set[str]:
        """The pods that exist: those an EndpointSlice's endpoint names (targetRef)."""
        return {ep["targetRef"]["name"] for sl in self.slices for ep in sl["endpoints"] if ep.get("targetRef")}

    def _patch_pod(self, h, name: str, raw: bytes):
        if name not in self.pod_names():
            return self._reply(h, 404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if h.headers.get("Content-Type") != "application/merge-patch+json":
            return self._reply(h, 415, {"kind": "Status", "code": 415})
        old = self.pods.get(name) or {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {"app.kubernetes.io/name": name.rsplit("-", 1)[0]}},
            "spec": {"containers": [{"name": "node", "image": "pdserve"}]}}  # fmt: skip
        new = merge_patch(copy.deepcopy(old), json.loads(raw))
        why = self.admission(old, new) if self.admission is not None else None
        if why:
            return self._reply(h, 403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                                        "code": 403, "message": why})  # fmt: skip
        self.pods[name] = new
        self.annotations[name] = dict(new["metadata"].get("annotations") or {})
        return self._reply(h, 200, new)

    def _watch(self, h, selector: tuple[str, str], since: int, timeout_s: float) -> None:
        """A WATCH: newline-delimited JSON events after `since` for matching slices, until timeoutSeconds,
        one HTTP/1.1 chunk per event (as the API server streams them; the client reads chunk by chunk), on a
        connection kept alive as the API server keeps it (a client stopping a watch shuts that socket down)."""
        h.protocol_version = "HTTP/1.1"
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        with self.cond:
            self.open_watches += 1
        try:
            self._stream_events(h, selector, since, timeout_s)
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.cond:
                self.open_watches -= 1

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
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": f"app={name}"}}  # fmt: skip

    def _handle(self, h, method: str):
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        self.requests.append({"method": method, "path": parts.path, "query": parse_qs(parts.query),
                              "content_type": h.headers.get("Content-Type"),
                              "body": json.loads(raw) if raw else None})  # fmt: skip
        for i, (m, status, *where) in enumerate(self.faults):
            if m == method and all(w in parts.path for w in where):
                del self.faults[i]
                reason = {409: "Conflict", 500: "InternalError", 403: "Forbidden"}.get(status, "Error")
                return self._reply(h, status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                               "reason": reason, "code": status})  # fmt: skip
        if (m := SCALE.match(parts.path)) and m["ns"] == self.namespace and m["name"] in self.replicas:
            if method == "GET":
                return self._reply(h, 200, self._scale(m["name"]))
            if method == "PATCH" and h.headers.get("Content-Type") == "application/merge-patch+json":
                self.replicas[m["name"]] = int(json.loads(raw)["spec"]["replicas"])
                return self._reply(h, 200, self._scale(m["name"]))
            return self._reply(h, 415, {"kind": "Status", "code": 415})
        if (m := PODS.match(parts.path)) and m["ns"] == self.namespace and method == "PATCH":
            return self._patch_pod(h, m["name"], raw)
        if (m := SLICES.match(parts.path)) and m["ns"] == self.namespace and method == "GET":
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


CONTRACT_NS = "pdserve-test"


def contract_twin(admission=None) -> KubeApiTwin:
    """The contract tests' cluster in namespace ``CONTRACT_NS``: prefill at 1 replica (one ready pod, one starting),
    decode at 2 (one ready, one of unknown readiness, one terminating)."""
    replicas = {"pdserve-prefill": 1, "pdserve-decode": 2}
    slices = [
        endpoint_slice("pdserve-prefill", "abcde", [("10.0.0.5", True, False, "pdserve-prefill-1"),
                                                    ("10.0.0.6", False, False, "pdserve-prefill-2")], CONTRACT_NS),
        endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", True, False, "pdserve-decode-1"),
                                                   ("10.0.1.8", None, False, "pdserve-decode-2"),
                                                   ("10.0.1.9", False, True, "pdserve-decode-3")], CONTRACT_NS),
    ]  # fmt: skip
    return KubeApiTwin(CONTRACT_NS, replicas, slices, admission=admission)
