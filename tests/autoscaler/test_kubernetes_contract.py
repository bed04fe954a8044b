"""Contract test of KubernetesActuator against a stand-in API server.

No cluster runs here. The server (tests/kubeapi.py: stdlib http.server on 127.0.0.1, port 0)
implements exactly the calls the actuator is allowed to make — the ones the RBAC Role
in deploy/base grants (tests/autoscaler/test_kubernetes_rbac.py) — and answers anything else with 404, so the
test pins the requests sent (method, path, query, content type, body) and the parsing of answers:

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (JSON merge patch)
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name=...
  PATCH /api/v1/namespaces/{ns}/pods/{name}                      (JSON merge patch of the pod-deletion-cost)

The gateway's side of the same EndpointSlices: tests/gateway/routing/test_kubernetes_source.py.
"""

from __future__ import annotations

import pytest

from tests import kubeapi

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")

from autoscaler import AutoscalerConfig, Backoff, ControlLoop, NodeInfo, RoleLoad
from autoscaler.actuator import PermanentActuatorError, TemporaryActuatorError
from autoscaler.kubernetes import KubernetesActuator, KubernetesConfig

NS = kubeapi.CONTRACT_NS
COST = "controller.kubernetes.io/pod-deletion-cost"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale"
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def endpoint_slice(service: str, suffix: str, endpoints: list[tuple[str, bool | None, bool, str]]) -> dict:
    return kubeapi.endpoint_slice(service, suffix, endpoints, NS)


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


def test_contract_pods_pending_past_their_time_bound_the_role_at_the_pods_placed(api, actuator):
    now = [100.0]
    actuator._clock = lambda: now[0]
    actuator.scale("decode", 4)  # 2 placed (a third is terminating): 2 pending
    assert actuator.capacity() == ()  # pending for less than pending_after_s: still being scheduled
    now[0] += 12.0
    (bound,) = actuator.capacity(serving=("http://10.0.1.7:8001",))
    assert (bound.kind, bound.roles, bound.limit, bound.serving, bound.room) == ("schedulable", ("decode",), 2, 1, 1)
    assert bound.why == "schedulable: 2 decode pods placed, 2 pending 12s → at most 2 serving decode nodes"
    assert {(m, p.replace("prefill", "decode")) for m, p in only(api)} <= {("GET", SCALE_PATH), ("GET", SLICES_PATH),
                                                                           ("PATCH", SCALE_PATH)}  # no new call
    actuator.scale("decode", 2)  # asked no more than placed: no bound, and the pending clock starts again
    assert actuator.capacity() == () and "decode" not in actuator._pending_since


def pod_patches(api) -> list[tuple[str, dict]]:
    return [(r["path"].rsplit("/", 1)[1], r["body"]["metadata"]["annotations"]) for r in api.requests
            if kubeapi.PODS.match(r["path"])]  # fmt: skip


def test_contract_scale_down_marks_the_pods_to_remove_with_a_low_deletion_cost(api, actuator):
    # decode has 2 replicas; the pool asks for 1 and names its standby runtimes, best to remove first
    # (one URL is no pod's any more: skipped)
    actuator.scale("decode", 1, prefer_remove=("http://10.0.9.9:8001", "http://10.0.1.8:8001", "http://10.0.1.7:8001"))
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("GET", SCALE_PATH), ("GET", SLICES_PATH),
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/pdserve-decode-2"), ("PATCH", SCALE_PATH),
    ]  # fmt: skip
    patch = api.requests[2]
    assert patch["content_type"] == "application/merge-patch+json"
    assert patch["body"] == {"metadata": {"annotations": {COST: "-1000"}}}
    assert api.requests[1]["query"] == {"labelSelector": ["kubernetes.io/service-name=pdserve-decode"]}
    assert api.annotations == {"pdserve-decode-2": {COST: "-1000"}}  # only the surplus: 2 - 1 pods
    assert api.replicas["pdserve-decode"] == 1


def test_contract_a_pod_marked_earlier_and_not_chosen_now_is_unmarked(api, actuator):
    api.faults = [("PATCH", 500, "/pods/")] * 4  # the mark fails (4 tries): no scale-down without it
    with pytest.raises(TemporaryActuatorError, match="annotate pod pdserve-decode-2"):
        actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))
    assert api.annotations == {} and api.replicas["pdserve-decode"] == 2
    api.faults = [("PATCH", 500, "/scale")] * 4  # now the scale patch fails after the mark: decode-2 stays marked
    with pytest.raises(TemporaryActuatorError):
        actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))
    assert api.annotations == {"pdserve-decode-2": {COST: "-1000"}} and api.replicas["pdserve-decode"] == 2
    # meanwhile the pool claimed decode-2: the next scale names another pod; decode-2 loses its mark first
    api.requests.clear()
    actuator.scale("decode", 1, prefer_remove=("http://10.0.1.7:8001",))
    assert pod_patches(api) == [("pdserve-decode-2", {COST: None}), ("pdserve-decode-1", {COST: "-1000"})]
    assert api.annotations == {"pdserve-decode-2": {}, "pdserve-decode-1": {COST: "-1000"}}
    # a scale-up unmarks too: no pod is to go
    api.requests.clear()
    actuator.scale("decode", 3)
    assert pod_patches(api) == [("pdserve-decode-1", {COST: None})] and api.replicas["pdserve-decode"] == 3
    api.requests.clear()
    actuator.scale("decode", 3)
    assert only(api) == [("PATCH", SCALE_PATH)]  # nothing marked, nothing to remove: one call


def test_contract_a_marked_pod_that_is_gone_is_not_patched_again(api, actuator):
    actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))
    # the ReplicaSet deleted decode-2: its endpoint leaves the slice; current() forgets the mark
    api.put_slice(endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", True, False, "pdserve-decode-1")]))
    actuator.current()
    api.requests.clear()
    actuator.scale("decode", 2)
    assert only(api) == [("PATCH", SCALE_PATH)]
    # a pod deleted between the list and its patch (404) needs no mark: the scale goes on
    api.faults = [("PATCH", 404)]
    actuator.scale("decode", 1, prefer_remove=("http://10.0.1.7:8001",))
    assert api.replicas["pdserve-decode"] == 1


def test_contract_scale_up_or_no_change_with_prefer_remove_patches_no_pod(api, actuator):
    actuator.scale("decode", 2, prefer_remove=("http://10.0.1.8:8001",))
    actuator.scale("decode", 4, prefer_remove=("http://10.0.1.8:8001",))
    assert only(api) == [("GET", SCALE_PATH), ("PATCH", SCALE_PATH)] * 2 and api.annotations == {}


def test_contract_forbidden_pod_patch_is_permanent_and_scales_nothing(api, actuator):
    api.faults = [("PATCH", 403)]
    with pytest.raises(PermanentActuatorError, match="annotate pod pdserve-decode-2.*HTTP 403"):
        actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))
    assert api.replicas["pdserve-decode"] == 2  # never a scale-down that could delete a serving pod


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
