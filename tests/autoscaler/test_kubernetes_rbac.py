"""The autoscaler's Role and admission policy in deploy/base, against the calls its actuator really makes on the
API twin (tests/kubeapi.py): the Role grants exactly those calls and nothing more, and the ValidatingAdmissionPolicy
beside it (run by the twin with cel-python, tests/admission.py) narrows its pod patches to the deletion cost."""

from __future__ import annotations

import httpx
import pytest

from tests import kubeapi
from tests.deploy.manifests import base_object

pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")

NS = kubeapi.CONTRACT_NS
COST = "controller.kubernetes.io/pod-deletion-cost"


def _rbac_of(req: dict) -> tuple[str, str, str, str]:
    """(apiGroup, resource, verb, name) of one recorded request, as the API server's authorizer sees it."""
    path, watch = req["path"], req["query"].get("watch") == ["true"]
    if m := kubeapi.SCALE.match(path):
        return ("apps", "deployments/scale", {"GET": "get", "PATCH": "patch"}[req["method"]], m["name"])
    if kubeapi.SLICES.match(path):
        return ("discovery.k8s.io", "endpointslices", "watch" if watch else "list", "")
    if m := kubeapi.PODS.match(path):
        return ("", "pods", {"GET": "get", "PATCH": "patch"}[req["method"]], m["name"])
    raise AssertionError(f"a call the twin does not serve: {req['method']} {path}")


def test_contract_the_admission_policy_admits_the_deletion_cost_and_nothing_else(api, actuator):
    """The Role's pod ``patch`` would let the autoscaler's credentials swap a pod's image (and so read every secret
    it mounts); the admission policy beside it admits only the pod-deletion-cost. The actuator's own patches
    (mark, then unmark) pass; an image swap, a label change or another annotation, sent with the same
    credentials, get 403 and change nothing."""
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
    rules = base_object("autoscaler.yaml", "Role", "pdserve-autoscaler")["rules"]
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
