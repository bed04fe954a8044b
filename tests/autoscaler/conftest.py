"""The Kubernetes API twin and the actuator over it, for tests/autoscaler/test_kubernetes_contract.py and
test_kubernetes_rbac.py: every pod patch admitted by deploy/base's ValidatingAdmissionPolicy (tests/admission.py
runs its CEL) as the autoscaler's service account."""

from __future__ import annotations

import pytest

from tests import kubeapi

AUTOSCALER_SA = "system:serviceaccount:pdserve:pdserve-autoscaler"  # as deploy/ names it (namespace pdserve)


@pytest.fixture
def api():
    from tests.admission import Policy
    from tests.deploy.manifests import base_object

    policy = Policy(base_object("autoscaler.yaml", "ValidatingAdmissionPolicy", "pdserve-autoscaler-pod-patches"))
    server = kubeapi.contract_twin(admission=lambda old, new: policy.deny(old, new, AUTOSCALER_SA))
    yield server
    server.close()


@pytest.fixture
def actuator(api):
    kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")
    from autoscaler.kubernetes import KubernetesActuator, KubernetesConfig

    sleeps: list[float] = []
    conf = kubernetes.client.Configuration(host=api.url)
    act = KubernetesActuator(KubernetesConfig(namespace=kubeapi.CONTRACT_NS), configuration=conf, sleep=sleeps.append)
    act.sleeps = sleeps
    yield act
    act.close()
