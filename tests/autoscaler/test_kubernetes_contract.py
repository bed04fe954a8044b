"""Contract test of KubernetesActuator against a stand-in API server.

No cluster runs here. The server (tests/kubeapi.py: stdlib http.server on 127.0.0.1, port 0)
implements exactly the calls the actuator is allowed to make — the ones the RBAC Role
in deploy/base grants — and answers anything else with 404, so the test pins the
requests sent (method, path, query, content type, body) and the parsing of answers:

  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
  PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (JSON merge patch)
  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name=...
  PATCH /api/v1/namespaces/{ns}/pods/{name}                      (JSON merge patch of the pod-deletion-cost)

every pod patch admitted by the ValidatingAdmissionPolicy beside the Role (tests/admission.py runs its CEL), as
the autoscaler's service account; and the gateway's node registry source (gateway/routing/discovery.py), which lists and then watches the
same EndpointSlices (list + watch: what the gateway's Role in deploy/base grants):

  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...&watch=true&resourceVersion=...
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests import kubeapi
from tests.admission import Policy
from tests.services import until

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")

from autoscaler import AutoscalerConfig, Backoff, ControlLoop, NodeInfo, RoleLoad
from autoscaler.actuator import PermanentActuatorError, TemporaryActuatorError
from autoscaler.kubernetes import KubernetesActuator, KubernetesConfig
from gateway.routing.discovery import DiscoveryConfig, KubernetesSource
from gateway.routing.registry import NodeRegistry

NS = "pdserve-test"
AUTOSCALER_SA = "system:serviceaccount:pdserve:pdserve-autoscaler"  # as deploy/ names it (namespace pdserve)
SCALE, SLICES = kubeapi.SCALE, kubeapi.SLICES
COST = "controller.kubernetes.io/pod-deletion-cost"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/pdserve-decode/scale"
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def endpoint_slice(service: str, suffix: str, endpoints: list[tuple[str, bool | None, bool, str]]) -> dict:
    return kubeapi.endpoint_slice(service, suffix, endpoints, NS)


def FakeApiServer() -> kubeapi.KubeApiTwin:
    replicas = {"pdserve-prefill": 1, "pdserve-decode": 2}
    slices = [
        endpoint_slice("pdserve-prefill", "abcde", [("10.0.0.5", True, False, "pdserve-prefill-1"),
                                                    ("10.0.0.6", False, False, "pdserve-prefill-2")]),
        endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", True, False, "pdserve-decode-1"),
                                                   ("10.0.1.8", None, False, "pdserve-decode-2"),
                                                   ("10.0.1.9", False, True, "pdserve-decode-3")]),
    ]  # fmt: skip
    policy = Policy(_manifest("deploy/base/autoscaler.yaml", "ValidatingAdmissionPolicy", "pdserve-autoscaler-pod-patches"))
    return kubeapi.KubeApiTwin(NS, replicas, slices, admission=lambda old, new: policy.deny(old, new, AUTOSCALER_SA))


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


# --- the gateway's node registry source: EndpointSlices listed, then watched -----------------------------


def _registry_state(reg: NodeRegistry) -> dict[str, tuple[str, bool, str]]:
    return {u: (n.role, n.draining, n.source) for u, n in reg.nodes.items()}


def _source(api, **kw) -> tuple[NodeRegistry, KubernetesSource]:
    reg = NodeRegistry({})
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=api.url))
    cfg = DiscoveryConfig(mode="kubernetes", namespace=NS, watch_timeout_s=kw.pop("watch_timeout_s", 30),
                          backoff_s=0.05, backoff_max_s=0.2, **kw)  # fmt: skip
    return reg, KubernetesSource(cfg, reg, api_client=client)


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("k8s-endpointslices-")]


def test_contract_gateway_registry_lists_then_watches_endpointslices_per_role(api):
    async def run():
        reg, src = _source(api)
        await src.start()
        try:
            await until(lambda: len(reg.nodes) == 5, 10, "the listed endpoints")
            assert _registry_state(reg) == {
                "http://10.0.0.5:8001": ("prefill", False, "kubernetes"),
                "http://10.0.0.6:8001": ("prefill", False, "kubernetes"),  # loading: known, routed once /load says so
                "http://10.0.1.7:8001": ("decode", False, "kubernetes"),
                "http://10.0.1.8:8001": ("decode", False, "kubernetes"),
                "http://10.0.1.9:8001": ("decode", True, "kubernetes"),  # terminating: never routed to
            }
            await until(lambda: sum(r["query"].get("watch") == ["true"] for r in api.requests) == 2, 10, "two watches")
            # scale-down of decode-1 (terminating), decode-3 gone, a new decode pod, and a second prefill slice
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", [("10.0.1.7", False, True, "pdserve-decode-1"),
                                                                     ("10.0.1.8", True, False, "pdserve-decode-2"),
                                                                     ("10.0.1.10", False, False, "pdserve-decode-4")]))
            api.put_slice(endpoint_slice("pdserve-prefill", "zzzzz", [("10.0.0.11", True, False, "pdserve-prefill-3")]))
            await until(lambda: "http://10.0.1.10:8001" in reg.nodes and "http://10.0.0.11:8001" in reg.nodes
                        and "http://10.0.1.9:8001" not in reg.nodes, 10, "the watched changes")  # fmt: skip
            assert reg.nodes["http://10.0.1.7:8001"].draining and not reg.nodes["http://10.0.1.8:8001"].draining
            assert reg.nodes["http://10.0.0.11:8001"].role == "prefill"
            api.delete_slice("pdserve-prefill-abcde")
            await until(lambda: "http://10.0.0.5:8001" not in reg.nodes, 10, "the deleted slice's endpoints")
            assert {u for u, n in reg.nodes.items() if n.role == "prefill"} == {"http://10.0.0.11:8001"}
            reg.add("http://127.0.0.1:9", "decode", "admin")  # another source's node: not this source's to remove
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", []))
            await until(lambda: not any(n.role == "decode" and n.source == "kubernetes" for n in reg.nodes.values()),
                        10, "the emptied decode slice")  # fmt: skip
            assert "http://127.0.0.1:9" in reg.nodes
        finally:
            await src.stop()
        # the stop ended both watch threads while the API server still streamed their watches: it cut them
        # short (order, not seconds: a stop that waited them out would see them end first, at their timeout)
        await until(lambda: not _watch_threads(), src.config.watch_timeout_s + 10, "the watch threads to end")
        assert api.open_watches == 2, f"{api.open_watches} of the 2 watches still open when the threads ended"
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
            await until(lambda: len(reg.nodes) == 3, 10, "the decode endpoints after the failed list")
            # the 1 s watch ends; the source re-lists and watches again (a change made meanwhile is seen)
            await until(lambda: sum(r["query"].get("watch") == ["true"] for r in api.requests) >= 2, 10, "a second watch")
            api.put_slice(endpoint_slice("pdserve-decode", "fghij", [("10.0.1.20", True, False, "pdserve-decode-9")]))
            await until(lambda: set(reg.nodes) == {"http://10.0.1.20:8001"}, 10, "the change after a re-list")
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


# --- the Role in deploy/base grants exactly the calls made ------------------------------------------------


def _rbac_of(req: dict) -> tuple[str, str, str, str]:
    """(apiGroup, resource, verb, name) of one recorded request, as the API server's authorizer sees it."""
    path, watch = req["path"], req["query"].get("watch") == ["true"]
    if m := SCALE.match(path):
        return ("apps", "deployments/scale", {"GET": "get", "PATCH": "patch"}[req["method"]], m["name"])
    if SLICES.match(path):
        return ("discovery.k8s.io", "endpointslices", "watch" if watch else "list", "")
    if m := kubeapi.PODS.match(path):
        return ("", "pods", {"GET": "get", "PATCH": "patch"}[req["method"]], m["name"])
    raise AssertionError(f"a call the twin does not serve: {req['method']} {path}")


def _manifest(path: str, kind: str, name: str) -> dict:
    import yaml

    from tests.deploy.pods import ROOT

    docs = yaml.safe_load_all((ROOT / path).read_text())
    (doc,) = [d for d in docs if d and d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _role_rules(path: str, name: str) -> list[dict]:
    return _manifest(path, "Role", name)["rules"]


def test_contract_the_admission_policy_admits_the_deletion_cost_and_nothing_else(api, actuator):
    """The Role's pod ``patch`` would let the autoscaler's credentials swap a pod's image (and so read every secret
    it mounts); the admission policy beside it admits only the pod-deletion-cost. The actuator's own patches
    (mark, then unmark) pass; an image swap, a label change or another annotation, sent with the same
    credentials, get 403 and change nothing."""
    import httpx

    actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))
    assert api.annotations == {"pdserve-decode-2": {COST: "-1000"}}
    actuator.scale("decode", 2)
    assert api.annotations == {"pdserve-decode-2": {}}
    before = api.pods["pdserve-decode-2"]
    for patch in ({"spec": {"containers": [{"name": "node", "image": "attacker/pdserve"}]}},
                  {"metadata": {"labels": {"app.kubernetes.io/name": "pdserve-gateway"}}},
                  {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": "now"}}}):  # fmt: skip
        r = httpx.patch(f"{api.url}/api/v1/namespaces/{NS}/pods/pdserve-decode-2", json=patch, timeout=5,
                        headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
        assert r.status_code == 403 and "pdserve-autoscaler-pod-patches" in r.json()["message"], (patch, r.text)
    assert api.pods["pdserve-decode-2"] == before


def _allowed(rule: dict, call: tuple[str, str, str, str]) -> bool:
    group, resource, verb, name = call
    return (group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            and (not rule.get("resourceNames") or name in rule["resourceNames"]))  # fmt: skip


def test_contract_the_autoscalers_role_grants_exactly_what_the_actuator_calls(api, actuator):
    actuator.replicas("prefill")
    actuator.current()
    actuator.endpoints_of("pdserve-gateway", "gateway")
    actuator.scale("decode", 1, prefer_remove=("http://10.0.1.8:8001",))  # mark, then scale down
    actuator.scale("prefill", 2)
    actuator.scale("decode", 2)  # unmark
    calls = {_rbac_of(r) for r in api.requests}
    rules = _role_rules("deploy/base/autoscaler.yaml", "pdserve-autoscaler")
    for call in calls:
        assert any(_allowed(rule, call) for rule in rules), f"the Role does not grant {call}"
    for rule in rules:  # and nothing more: every (group, resource, verb) granted is one called
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    used = {c for c in calls if c[:3] == (group, resource, verb)}
                    assert used, f"the Role grants {verb} {group}/{resource}, which the actuator never calls"
                    if rule.get("resourceNames"):
                        assert {c[3] for c in used} <= set(rule["resourceNames"])
