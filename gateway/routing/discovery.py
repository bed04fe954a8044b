"""Where the gateway's node registry learns which nodes exist: its sources.

  static      ``--node ROLE=URL`` / ``[gateway] nodes``: registered once, at start (gateway.service)
  local       the local actuator's callbacks (``pdserve up``: autoscaler.up.registry_hooks)
  kubernetes  the EndpointSlices of the node Services, listed then watched (this module)

Lifecycle of the Kubernetes source (one thread per role, label-selected by that role's Service):
 1. construction: the API client comes from the pod's service account in a cluster, else from a
    kubeconfig ($KUBECONFIG) — neither is a one-line error before the gateway serves; ``start()``
    (on the gateway's event loop) starts one thread per role;
 2. the thread LISTs ``endpointslices?labelSelector=kubernetes.io/service-name=<service>`` and
    WATCHes from the list's resourceVersion: each ADDED / MODIFIED / DELETED slice replaces that
    slice's endpoints, and the role's union of endpoints is handed to the event loop;
 3. on the loop, the union is diffed against what this source registered: a new endpoint is
    ``add``ed (the registry's own /load polling decides when it is routable — a loading pod is
    known but not routed to), a terminating one is ``mark_draining``ed at once (no new request
    reaches a pod that is scaling down), a vanished one is ``remove``d;
 4. a watch that ends (timeoutSeconds, 410 Gone, an API error) is re-listed, after an exponential
    backoff when it failed; a failure is one log line, never the end of the source;
 5. ``stop()``: the threads stop at their next event or within a second (the open WATCH response
    is closed under them); the API client is closed.

RBAC: list and watch of ``discovery.k8s.io/endpointslices`` in the namespace (deploy/base/gateway.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.gateway")

MODES = ("auto", "static", "kubernetes")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(slots=True)
class DiscoveryConfig:
    """How the gateway finds its nodes (``[gateway.discovery]`` in the config file)."""

    mode: str = "auto"  # auto: kubernetes inside a pod ($KUBERNETES_SERVICE_HOST), else static | static | kubernetes
    namespace: str | None = None  # None: the pod's own (service account), else the kubeconfig context's
    services: dict[str, str] = field(
        default_factory=lambda: {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
    )  # role -> the Service whose EndpointSlices list that role's nodes
    port_name: str = "http"  # EndpointSlice port serving the node API (the first port if none has the name)
    scheme: str = "http"  # node URL scheme
    kubeconfig: str | None = None  # outside a cluster: this file (else $KUBECONFIG, ~/.kube/config)
    watch_timeout_s: int = 60  # server-side end of one WATCH; then it is re-listed
    backoff_s: float = 0.5  # first wait after a failed list/watch, doubling up to backoff_max_s
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"invalid gateway discovery mode {self.mode!r}: one of {', '.join(MODES)}")
        for role in self.services:
            if role not in ("prefill", "decode", "both"):
                raise ValueError(f"invalid role {role!r} in gateway discovery services")
        if self.watch_timeout_s < 1 or not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("need watch_timeout_s >= 1 and 0 < backoff_s <= backoff_max_s")

    def resolved_mode(self, env: dict | None = None) -> str:
        env = os.environ if env is None else env
        if self.mode != "auto":
            return self.mode
        return "kubernetes" if env.get("KUBERNETES_SERVICE_HOST") else "static"


def make_source(config: DiscoveryConfig, registry, **kw):
    """The registry source the config asks for, or None (static nodes only)."""
    if config.resolved_mode() == "kubernetes":
        return KubernetesSource(config, registry, **kw)
    return None


class KubernetesSource:
    """Feeds a NodeRegistry from the node Services' EndpointSlices (lifecycle in the module docstring)."""

    source = "kubernetes"

    def __init__(self, config: DiscoveryConfig, registry, *, api_client=None):
        self.config = config
        self.registry = registry
        self._api_client = api_client if api_client is not None else self._load_client()  # fails here, not later
        self.namespace = config.namespace or self._own_namespace()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: set = set()  # open kubernetes.watch.Watch objects, closed by stop()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.registered: dict[str, dict[str, str]] = {role: {} for role in config.services}  # role -> url -> state

    # --- lifecycle ---

    async def start(self) -> None:
        from kubernetes import client as k8s

        self._loop = asyncio.get_running_loop()
        api = k8s.DiscoveryV1Api(self._api_client)
        for role, service in self.config.services.items():
            t = threading.Thread(target=self._run, args=(api, role, service), daemon=True,
                                 name=f"k8s-endpointslices-{role}")  # fmt: skip
            t.start()
            self._threads.append(t)
        log.info("node discovery: EndpointSlices of %s in namespace %s",
                 ", ".join(f"{s} ({r})" for r, s in self.config.services.items()), self.namespace)  # fmt: skip

    async def stop(self) -> None:
        self._stop.set()
        for w in list(self._watches):
            _interrupt(getattr(w, "_resp", None))
        for t in self._threads:
            await asyncio.to_thread(t.join, 1.0)
        if self._api_client is not None:
            self._api_client.close()

    # --- the watch thread ---

    def _run(self, api, role: str, service: str) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={service}"
        delay = self.config.backoff_s
        slices: dict[str, dict[str, str]] = {}
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                            _request_timeout=10)  # fmt: skip
                slices = {sl.metadata.name: self._endpoints(sl) for sl in listed.items or []}
                self._publish(role, slices)
                w = watch.Watch()
                self._watches.add(w)
                try:
                    self._follow(api, w, role, selector, listed.metadata.resource_version, slices)
                finally:
                    self._watches.discard(w)
                delay = self.config.backoff_s  # a watch that ran its course: re-list at once
            except Exception as e:  # noqa: BLE001 - the source outlives any API error
                if self._stop.is_set():
                    break
                log.warning("node discovery (%s): %s: %s; retrying in %.1f s", service, type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "", delay)  # fmt: skip
                self._stop.wait(delay)
                delay = min(delay * 2, self.config.backoff_max_s)

    def _follow(self, api, w, role: str, selector: str, since: str, slices: dict) -> None:
        """One WATCH from resourceVersion `since`: apply each event to `slices`, publish the role's union."""
        for ev in w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                           resource_version=since, allow_watch_bookmarks=True,
                           timeout_seconds=self.config.watch_timeout_s,
                           _request_timeout=(5, self.config.watch_timeout_s + 5)):  # fmt: skip
            if self._stop.is_set():
                w.stop()
                return
            kind, sl = ev["type"], ev["object"]
            if kind in ("ADDED", "MODIFIED"):
                slices[sl.metadata.name] = self._endpoints(sl)
            elif kind == "DELETED":
                slices.pop(sl.metadata.name, None)
            else:  # BOOKMARK, or an ERROR the client did not raise
                continue
            self._publish(role, slices)

    def _endpoints(self, sl) -> dict[str, str]:
        """url -> ready | loading | draining, for one EndpointSlice."""
        return {url: state for url, state, _ in slice_endpoints(sl, self.config.port_name, self.config.scheme)}

    def _publish(self, role: str, slices: dict[str, dict[str, str]]) -> None:
        union: dict[str, str] = {}
        for eps in slices.values():
            for url, state in eps.items():
                if union.get(url) != "ready":  # the same pod in two slices (a resync): the best state wins
                    union[url] = state
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._apply, role, union)

    # --- on the event loop ---

    def _apply(self, role: str, desired: dict[str, str]) -> None:
        mine = self.registered[role]
        for url in [u for u in mine if u not in desired]:
            self.registry.remove(url)
            del mine[url]
            log.info("node gone (EndpointSlice): %s (%s)", url, role)
        for url, state in desired.items():
            if url not in mine:
                try:
                    self.registry.add(url, role, self.source)
                except ValueError as e:  # an endpoint that is no node's URL: never challenged, polled or routed to
                    log.warning("discovered endpoint skipped: %s", e)
                    continue
                asyncio.get_running_loop().create_task(self.registry.refresh(url))
            if state == "draining" and mine.get(url) != "draining":
                self.registry.mark_draining(url)
            mine[url] = state

    # --- helpers ---

    def _load_client(self):
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config()
            return k8s.ApiClient()
        try:
            return k8s_config.new_client_from_config(config_file=self.config.kubeconfig)
        except (k8s_config.ConfigException, OSError) as e:
            raise ValueError(f"gateway discovery = kubernetes, but not in a pod and no usable kubeconfig: {e}") from e

    def _own_namespace(self) -> str:
        try:
            with open(os.path.join(SA_DIR, "namespace")) as f:
                return f.read().strip() or "default"
        except OSError:
            pass
        try:
            from kubernetes import config as k8s_config

            _, active = k8s_config.list_kube_config_contexts(config_file=self.config.kubeconfig)
            return (active or {}).get("context", {}).get("namespace") or "default"
        except Exception:  # noqa: BLE001 - no kubeconfig context: the default namespace
            return "default"


def slice_endpoints(sl, port_name: str, scheme: str = "http") -> list[tuple[str, str, str]]:
    """(url, ready | loading | draining, pod name) of each endpoint of one EndpointSlice.

    Kubernetes' rules: an unset ``ready`` means ready; ``terminating`` wins over ready. The port
    is the one named ``port_name``, else the slice's first; a slice without ports has no endpoints.
    """
    port = _port(sl.ports or [], port_name)
    if port is None:
        return []
    out = []
    for ep in sl.endpoints or []:
        if not ep.addresses:
            continue
        host = ep.addresses[0]
        host = f"[{host}]" if ":" in host else host  # IPv6
        cond = ep.conditions
        if cond is not None and cond.terminating:
            state = "draining"
        elif cond is None or cond.ready is None or cond.ready:
            state = "ready"
        else:
            state = "loading"
        name = ep.target_ref.name if ep.target_ref and ep.target_ref.name else ""
        out.append((f"{scheme}://{host}:{port}", state, name))
    return out


def _port(ports: list, name: str) -> int | None:
    for p in ports:
        if p.name == name and p.port:
            return int(p.port)
    return int(ports[0].port) if ports and ports[0].port else None


def _interrupt(resp) -> None:
    """End a read blocked on an open WATCH response from another thread: shutting the socket down wakes
    the reader (closing it would not); best effort — the watch's timeoutSeconds bounds it anyway."""
    resp = getattr(resp, "urllib3_response", resp)  # a kubernetes RESTResponse wraps the urllib3 one
    conn = getattr(resp, "_connection", None) or getattr(resp, "connection", None)
    sock = getattr(conn, "sock", None)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
