"""KubernetesActuator: the runtime actuator of the node pods — sizes the prefill and decode Deployments.

The node pods are runtimes (`pdserve node --role R`, no model): autoscaler/pool.py's RuntimePool
claims them through the node API (POST /internal/models/load) and sizes each Deployment to the
runtimes it keeps busy plus its standby pool through this actuator. `scale(role, n, prefer_remove)`
on a scale-down first marks the pods to remove (standby runtimes, named by URL) with a low
`controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet controller deletes those and not a
pod that serves a model; a pod marked by an earlier call and not chosen now is unmarked (this process
remembers its marks: a mark left by a scale-down whose scale patch failed just before a restart stays until
that pod is chosen again or removed — it can only make that pod go first).

The API calls it makes — exactly these, which the RBAC Role in deploy/base/autoscaler.yaml grants
and tests/autoscaler/test_kubernetes_contract.py serves:
  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          replicas(); scale() before a scale-down
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          scale()
        Content-Type: application/merge-patch+json, body {"spec": {"replicas": N}}
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices
        ?labelSelector=kubernetes.io/service-name={service}              current(), endpoints_of(); scale() before
                                                                         a scale-down (URL -> pod, the targetRef)
  PATCH /api/v1/namespaces/{ns}/pods/{pod}                              scale() with prefer_remove
        Content-Type: application/merge-patch+json, body
        {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}}
        (null instead of the value unmarks a pod)

Capacity (``capacity()``, the policy's bound): pods asked for that have had no endpoint for
``pending_after_s`` could not be scheduled; then a role serves on at most the pods placed — pending pods
are not capacity, and the decision held back says so in `pdserve status` (same two calls as above).

Scale-down drains through the pods themselves: Kubernetes sends SIGTERM after the
preStop hook (POST /internal/drain on the node), within terminationGracePeriodSeconds.

Each call is retried in place a few times on 5xx / 409 / 429 / connection errors with
exponential backoff, then surfaces as TemporaryActuatorError (the loop backs off);
401 / 403 / 404 / 422 are PermanentActuatorError (fix RBAC or the manifests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from gateway.routing.discovery import slice_endpoints

from .actuator import Actuator, NodeInfo, PermanentActuatorError, TemporaryActuatorError
from .backoff import Backoff, retry
from .capacity import CapacityBound

T = TypeVar("T")

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MERGE_PATCH = "application/merge-patch+json"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # ReplicaSets delete the lowest-cost pods first
_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


@dataclass(slots=True)
class KubernetesConfig:
    """Which objects the actuator drives, and how hard it retries."""

    namespace: str | None = None  # None: the pod's own namespace (service account), else "default"
    deployments: dict[str, str] = field(
        default_factory=lambda: {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
    )  # role -> Deployment
    services: dict[str, str] = field(
        default_factory=lambda: {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
    )  # role -> Service
    port_name: str = "http"  # EndpointSlice port that serves the node's HTTP API (first port if absent)
    scheme: str = "http"  # node URL scheme
    attempts: int = 4  # tries per API call before the loop backs off
    backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.2, factor=2.0, max_s=5.0))  # between tries
    request_timeout_s: float = 10.0  # per HTTP request
    field_manager: str = "pdserve-autoscaler"  # recorded as the owner of spec.replicas
    remove_cost: int = -1000  # pod-deletion-cost of the pods a scale-down removes first (unmarked pods: 0)
    pending_after_s: float = 10.0  # pods asked for that have no endpoint this long cannot be scheduled: the
    #   role's capacity bound is then the pods placed (capacity(); pending pods are not capacity)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1")
        if not -(2**31) <= self.remove_cost < 0:
            raise ValueError(f"remove_cost={self.remove_cost} must be a negative int32 (below the default 0)")
        if self.pending_after_s < 0:
            raise ValueError(f"pending_after_s={self.pending_after_s} must be >= 0")
        if set(self.deployments) != set(self.services):
            raise ValueError("deployments and services must name the same roles")


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (KUBECONFIG / ~/.kube/config)."""
    try:
        k8s_config.load_incluster_config()
        return k8s.ApiClient()
    except k8s_config.ConfigException:
        return k8s_config.new_client_from_config(config_file=kubeconfig, context=context)


class KubernetesActuator(Actuator):
    def __init__(self, config: KubernetesConfig | None = None, *, api_client: k8s.ApiClient | None = None,
                 configuration: k8s.Configuration | None = None, kubeconfig: str | None = None,
                 context: str | None = None, sleep: Callable[[float], None] = time.sleep, **kw: Any):  # fmt: skip
        self.config = config or KubernetesConfig(**kw)
        if api_client is None:
            api_client = k8s.ApiClient(configuration) if configuration else load_api_client(kubeconfig, context)
        self.api_client = api_client
        self.apps = k8s.AppsV1Api(api_client)
        self.core = k8s.CoreV1Api(api_client)
        self.discovery = k8s.DiscoveryV1Api(api_client)
        self._marked: dict[str, set[str]] = {}  # role -> pods this actuator gave remove_cost, still to unmark
        self.namespace = self.config.namespace or _own_namespace(None if configuration else kubeconfig, context)
        self._sleep = sleep
        self._clock = time.monotonic
        self._pending_since: dict[str, float] = {}  # role -> since when pods asked for have had no endpoint

    # --- the contract ---

    def replicas(self, role: str) -> int:
        name = self._deployment(role)
        scale = self._call(f"read scale of deployment {name}", lambda: self.apps.read_namespaced_deployment_scale(
            name, self.namespace, _request_timeout=self.config.request_timeout_s))  # fmt: skip
        return int((scale.spec and scale.spec.replicas) or 0)

    def scale(self, role: str, replicas: int, prefer_remove: Sequence[str] = ()) -> None:
        """Set the role's Deployment to `replicas` pods; on a scale-down, the pods behind the first
        (current - replicas) URLs of `prefer_remove` that still exist are the ones deleted."""
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        name = self._deployment(role)
        chosen: list[str] = []
        if prefer_remove and (surplus := self.replicas(role) - replicas) > 0:
            pods = {n.url: n.name for n in self._nodes(role, self.config.services[role]) if n.name}
            chosen = [pods[u] for u in dict.fromkeys(prefer_remove) if u in pods][:surplus]
        for pod in sorted(self._marked.get(role, set()) - set(chosen)):  # an earlier choice, not this one
            self._mark(pod, None)
            self._marked[role].discard(pod)
        for pod in chosen:
            self._mark(pod, str(self.config.remove_cost))
            self._marked.setdefault(role, set()).add(pod)
        body = {"spec": {"replicas": int(replicas)}}
        self._call(f"scale deployment {name} to {replicas}", lambda: self.apps.patch_namespaced_deployment_scale(
            name, self.namespace, body, field_manager=self.config.field_manager, _content_type=MERGE_PATCH,
            _request_timeout=self.config.request_timeout_s))  # fmt: skip

    def current(self) -> dict[str, list[NodeInfo]]:
        nodes = {role: self._nodes(role, svc) for role, svc in self.config.services.items()}
        for role, marked in self._marked.items():  # a marked pod that is gone needs no unmarking
            marked &= {n.name for n in nodes.get(role, [])}
        return nodes

    def capacity(self, serving: tuple[str, ...] | None = None) -> tuple[CapacityBound, ...]:
        """Per role, once pods asked for have had no endpoint (not scheduled: no node has room for them) for
        pending_after_s: at most the pods placed serve (``serving``: the URLs holding a model; None: every
        placed pod). Pending pods are not capacity; the decision held back says so in `pdserve status`."""
        out, now = [], self._clock()
        for role, svc in self.config.services.items():
            placed = [n for n in self._nodes(role, svc) if n.state != "draining"]  # terminating: leaving
            pending = self.replicas(role) - len(placed)
            if pending <= 0:
                self._pending_since.pop(role, None)
                continue
            since = self._pending_since.setdefault(role, now)
            if now - since < self.config.pending_after_s:
                continue
            busy = sum(1 for n in placed if serving is None or n.url in serving)
            out.append(CapacityBound("schedulable", limit=len(placed), serving=busy, roles=(role,), why=(
                f"schedulable: {len(placed)} {role} pods placed, {pending} pending {now - since:.0f}s "
                f"→ at most {len(placed)} serving {role} nodes")))  # fmt: skip
        return tuple(out)

    def endpoints(self) -> list[tuple[str, str, bool]]:
        """(role, url, ready) for every node endpoint — what the gateway's node registry takes."""
        return [(n.role, n.url, n.ready) for nodes in self.current().values() for n in nodes]

    def endpoints_of(self, service: str, role: str = "") -> list[NodeInfo]:
        """The endpoints of another Service of the namespace (`pdserve autoscale` finds the gateway pods so)."""
        return self._nodes(role, service)

    def close(self) -> None:
        self.api_client.close()

    # --- helpers ---

    def _deployment(self, role: str) -> str:
        try:
            return self.config.deployments[role]
        except KeyError:
            raise PermanentActuatorError(f"no Deployment configured for role {role!r}") from None

    def _mark(self, pod: str, cost: str | None) -> None:
        """Set (or, with None, remove) the pod's deletion cost; a pod already gone needs none."""
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        try:
            self._call(f"annotate pod {pod} with {DELETION_COST}={cost}", lambda: self.core.patch_namespaced_pod(
                pod, self.namespace, body, _content_type=MERGE_PATCH, _request_timeout=self.config.request_timeout_s))  # fmt: skip
        except PermanentActuatorError as e:
            if getattr(e.__cause__, "status", None) != 404:
                raise

    def _nodes(self, role: str, service: str) -> list[NodeInfo]:
        slices = self._call(f"list endpointslices of service {service}", lambda: (
            self.discovery.list_namespaced_endpoint_slice(self.namespace,
                label_selector=f"kubernetes.io/service-name={service}",
                _request_timeout=self.config.request_timeout_s)))  # fmt: skip
        seen: dict[str, NodeInfo] = {}
        for sl in slices.items or []:
            for url, state, name in slice_endpoints(sl, self.config.port_name, self.config.scheme):
                seen[url] = NodeInfo(role=role, url=url, ready=state == "ready", name=name, state=state)
        return sorted(seen.values(), key=lambda n: n.url)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retry(fn, attempts=self.config.attempts, backoff=self.config.backoff, retryable=_retryable,
                         sleep=self._sleep)  # fmt: skip
        except ApiException as e:
            msg = f"{what}: HTTP {e.status} {e.reason or ''}".strip()
            if e.status in _RETRY_STATUS:
                raise TemporaryActuatorError(f"{msg} (after {self.config.attempts} tries)") from e
            raise PermanentActuatorError(f"{msg} (check RBAC and manifests)") from e
        except Exception as e:  # connection refused, timeouts, TLS
            raise TemporaryActuatorError(f"{what}: {type(e).__name__}: {e}") from e


def _retryable(e: BaseException) -> bool:
    if isinstance(e, ApiException):
        return e.status in _RETRY_STATUS
    return isinstance(e, (OSError, TimeoutError)) or type(e).__module__.startswith("urllib3")


def _own_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """The pod's namespace (service account), else the kubeconfig context's, else "default"."""
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        pass
    try:
        contexts, active = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), active) if context else active
        return (chosen or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # noqa: BLE001 - no kubeconfig: the default namespace
        return "default"
