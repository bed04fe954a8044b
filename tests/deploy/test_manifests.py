"""deploy/: both overlays render with `kubectl kustomize`, validate against the Kubernetes schemas, and keep
their promises — least-privilege RBAC, resources, bounded drains, Secrets only by reference — and the alerts
and dashboard parse. That the containers' commands, flags, files, probes and hooks work is tested by running
them: tests/deploy/test_pods.py (and `make test-deploy`); that the alerts and the dashboard work, on a real
Prometheus scraping `pdserve up` as the ServiceMonitor says: tests/deploy/test_observability.py."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from tests.deploy.manifests import DEPLOY, metric_names, objects, render

OVERLAYS = ["local", "production"]
K8S_VERSION = "1.30"  # the oldest Kubernetes these manifests promise to work on
# Custom resources whose schemas are not among the core ones: skipped by name, every other kind must validate.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
NODE_ROLES = ("prefill", "decode")
SECRET_FILES = {  # *_FILE env var -> (Secret, key) mounted where it points; values live in the cluster only
    "PDSERVE_API_KEYS_FILE": ("pdserve-secrets", "api-keys"),
    "PDSERVE_ADMIN_KEY_FILE": ("pdserve-secrets", "admin-key"),
    "PDSERVE_INTERNAL_TOKEN_FILE": ("pdserve-secrets", "internal-token"),
    "AWS_SHARED_CREDENTIALS_FILE": ("pdserve-s3", "credentials"),
}
# cAdvisor's (the kubelet's), for the resource panels; every pdserve_/paramstore_ name an alert or a panel uses is
# checked against a real Prometheus scraping `pdserve up` (tests/deploy/test_observability.py)
CADVISOR = {"container_cpu_usage_seconds_total", "container_memory_working_set_bytes"}


def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def container(dep: dict) -> dict:
    (c,) = pod_spec(dep)["containers"]
    return c


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def test_overlays_render_the_same_set_of_objects(overlay):
    got = sorted((o["kind"], o["metadata"]["name"]) for o in render(overlay))
    config = next(n for k, n in got if k == "ConfigMap")
    assert re.fullmatch(r"pdserve-config-[a-z0-9]{10}", config)  # generated: a change rolls the pods
    assert got == sorted([
        ("ConfigMap", config), ("Deployment", "pdserve-autoscaler"), ("Deployment", "pdserve-decode"),
        ("Deployment", "pdserve-gateway"), ("Deployment", "pdserve-prefill"), ("NetworkPolicy", "pdserve-nodes"),
        ("PodDisruptionBudget", "pdserve-decode"), ("PodDisruptionBudget", "pdserve-gateway"),
        ("PodDisruptionBudget", "pdserve-prefill"), ("PrometheusRule", "pdserve"), ("Role", "pdserve-autoscaler"),
        ("Role", "pdserve-gateway"), ("RoleBinding", "pdserve-autoscaler"), ("RoleBinding", "pdserve-gateway"),
        ("Service", "pdserve-decode"), ("Service", "pdserve-gateway"), ("Service", "pdserve-prefill"),
        ("ServiceAccount", "pdserve-autoscaler"), ("ServiceAccount", "pdserve-gateway"), ("ServiceMonitor", "pdserve"),
        ("ValidatingAdmissionPolicy", "pdserve-autoscaler-pod-patches"),
        ("ValidatingAdmissionPolicyBinding", "pdserve-autoscaler-pod-patches"),
    ])  # fmt: skip
    assert {o["metadata"].get("namespace") for o in render(overlay)} == {"pdserve"}


def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (ships its schemas)")
    skipped = []
    for obj in render(overlay):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            skipped.append(obj["kind"])
            continue
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
    assert sorted(skipped) == ["PrometheusRule", "ServiceMonitor"]


def _grants(role: dict) -> set[tuple]:
    return {
        (g, r, v, tuple(sorted(rule.get("resourceNames", ()))))
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_rbac_grants_exactly_what_the_autoscaler_and_the_gateway_call(overlay):
    """The calls themselves are pinned on the API twin: the autoscaler's by tests/autoscaler/test_kubernetes_contract.py
    and test_kubernetes_rbac.py, the gateway's by tests/gateway/routing/test_kubernetes_source.py."""
    from autoscaler.kubernetes import KubernetesConfig

    roles = objects(overlay, "Role")
    names = tuple(sorted(KubernetesConfig().deployments.values()))
    assert _grants(roles["pdserve-autoscaler"]) == {
        ("apps", "deployments/scale", "get", names), ("apps", "deployments/scale", "patch", names),
        ("discovery.k8s.io", "endpointslices", "list", ()),  # the nodes (and gateway pods) it lists
        ("", "pods", "patch", ()),  # the pod-deletion-cost of the pods a scale-down removes first
    }  # fmt: skip
    assert _grants(roles["pdserve-gateway"]) == {  # the EndpointSlice watch of its node registry: read only
        ("discovery.k8s.io", "endpointslices", "list", ()), ("discovery.k8s.io", "endpointslices", "watch", ()),
    }  # fmt: skip
    assert not [o for o in render(overlay) if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    deps = objects(overlay, "Deployment")
    for name, binding in objects(overlay, "RoleBinding").items():
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "pdserve"}]
        assert pod_spec(deps[name])["serviceAccountName"] == name
    for name, dep in deps.items():  # nobody else holds an API token
        if name not in roles:
            assert pod_spec(dep)["automountServiceAccountToken"] is False, name


def test_actuator_names_match_the_manifests(overlay):
    from autoscaler.kubernetes import KubernetesConfig

    kc, deps, svcs = KubernetesConfig(), objects(overlay, "Deployment"), objects(overlay, "Service")
    for role in NODE_ROLES:
        dep, svc = deps[kc.deployments[role]], svcs[kc.services[role]]
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert kc.port_name in [p["name"] for p in svc["spec"]["ports"]]
        assert container(dep)["args"][:3] == ["node", "--role", role]
        assert "replicas" not in dep["spec"]  # owned by the autoscaler: re-applying must not reset it


def test_node_drain_is_bounded_within_the_grace_period(overlay):
    """The hook itself is run by tests/deploy/test_pods.py; here: its bounds fit the pod's grace period."""
    for role in NODE_ROLES:
        dep = objects(overlay, "Deployment")[f"pdserve-{role}"]
        script = container(dep)["lifecycle"]["preStop"]["exec"]["command"][-1]
        drain_s = float(re.search(r"timeout_s=(\d+)", script)[1])  # the node's own bound on the drain
        client_s = float(re.search(r"timeout=(\d+)", script)[1])  # the hook's wait for it
        assert drain_s <= client_s < pod_spec(dep)["terminationGracePeriodSeconds"]


def test_every_deployment_has_resources_and_a_grace_period(overlay):
    for name, dep in objects(overlay, "Deployment").items():
        assert pod_spec(dep)["terminationGracePeriodSeconds"] > 0, name
        for c in pod_spec(dep)["containers"]:
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{name}/{c['name']} {part}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod_spec(dep)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(dep)["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name


def test_secrets_are_files_referenced_never_inlined(overlay):
    """No secret in any container's environment (which /proc/PID/environ, crash dumps and child processes see):
    each is a Secret's key mounted as a file, its *_FILE variable naming the path (the pods run them:
    tests/deploy/test_pods.py, make test-deploy)."""
    assert not [o for o in render(overlay) if o["kind"] == "Secret"]
    seen = set()
    for name, dep in objects(overlay, "Deployment").items():
        vols = {v["name"]: v for v in pod_spec(dep)["volumes"]}
        for c in pod_spec(dep)["containers"]:
            assert not any("secretRef" in e for e in c.get("envFrom", []))
            mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", [])}
            for env in c.get("env", []):
                assert "secretKeyRef" not in env.get("valueFrom", {}), f"{name}: {env['name']} from a Secret"
                if env["name"] in SECRET_FILES:
                    where, _, path = env["value"].rpartition("/")
                    secret = mounts[where]["secret"]
                    assert mounts[where] and all(m["readOnly"] for m in c["volumeMounts"] if m["mountPath"] == where)
                    item = next(i for i in secret["items"] if i["path"] == path)
                    assert (secret["secretName"], item["key"]) == SECRET_FILES[env["name"]]
                    seen.add(env["name"])
                elif re.search(r"KEY|TOKEN|SECRET|PASSWORD", env["name"]):
                    pytest.fail(f"{name}: {env['name']} looks like a secret in the environment")
    assert seen == set(SECRET_FILES)
    env = {e["name"] for e in container(objects(overlay, "Deployment")["pdserve-gateway"])["env"]}
    assert {"PDSERVE_API_KEYS_FILE", "PDSERVE_ADMIN_KEY_FILE", "PDSERVE_INTERNAL_TOKEN_FILE"} <= env
    for cm in objects(overlay, "ConfigMap").values():  # knobs only
        assert not re.search(r"(?i)(secret|password|token|access_key)\s*=", "\n".join(cm["data"].values()))


def test_one_image_runs_every_role(overlay):
    deps = objects(overlay, "Deployment")
    images = {container(d)["image"] for d in deps.values()}
    assert images == {"pdserve:dev" if overlay == "local" else "registry.example.com/pdserve:0.1.0"}
    assert deps["pdserve-autoscaler"]["spec"]["replicas"] == 1
    assert deps["pdserve-autoscaler"]["spec"]["strategy"]["type"] == "Recreate"


def test_overlay_sizes():
    local, prod = objects("local", "Deployment"), objects("production", "Deployment")
    assert local["pdserve-gateway"]["spec"]["replicas"] == 1 and prod["pdserve-gateway"]["spec"]["replicas"] == 3
    for role in NODE_ROLES:
        assert container(local[f"pdserve-{role}"])["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
        assert container(prod[f"pdserve-{role}"])["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "nvidia.com/gpu" not in container(local[f"pdserve-{role}"])["resources"]["limits"]


def test_config_map_holds_valid_knobs(overlay):
    """Every other key is read by the commands the pod runner starts (an unknown key stops them)."""
    (cm,) = objects(overlay, "ConfigMap").values()
    cfg = tomllib.loads(cm["data"]["pdserve.toml"])
    store = cfg["store"]  # replaced by a local store in the pod runner: checked here
    assert len(set(store["locations"])) >= store["k"] + store["m"]  # imports need k+m distinct locations
    for name, dep in objects(overlay, "Deployment").items():
        vols = {v["name"]: v for v in pod_spec(dep)["volumes"]}
        assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"], name
        assert {"name": "config", "mountPath": "/etc/pdserve", "readOnly": True} in container(dep)["volumeMounts"]


def test_disruption_budgets_and_services_select_their_pods(overlay):
    deps = objects(overlay, "Deployment")
    for kind in ("PodDisruptionBudget", "Service"):
        for name, obj in objects(overlay, kind).items():
            sel = obj["spec"]["selector"].get("matchLabels", obj["spec"]["selector"])
            assert sel.items() <= deps[name]["spec"]["template"]["metadata"]["labels"].items(), f"{kind}/{name}"
    (sm,) = objects(overlay, "ServiceMonitor").values()
    scraped = [s for s in objects(overlay, "Service").values()
               if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]  # fmt: skip
    assert sorted(s["metadata"]["name"] for s in scraped) == ["pdserve-decode", "pdserve-gateway", "pdserve-prefill"]
    assert all(sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in s["spec"]["ports"]] for s in scraped)


def test_alert_rules_use_the_design_thresholds():
    """That they evaluate, fire and stay silent, on metrics the services expose: tests/deploy/test_observability.py."""
    (rule,) = objects("production", "PrometheusRule").values()
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"PdserveDecodeLoadHigh", "PdserveShardLoadSlow", "PdserveShardCacheHitRatioLow",
                           "PdserveGatewayErrorRate"}  # fmt: skip
    used = set()
    for r in alerts.values():
        used |= metric_names(r["expr"])
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    decode = alerts["PdserveDecodeLoadHigh"]
    assert decode["for"] == "5m" and decode["expr"].rstrip().endswith("> 0.8")
    assert "histogram_quantile(0.99" in alerts["PdserveShardLoadSlow"]["expr"]
    assert alerts["PdserveShardLoadSlow"]["expr"].rstrip().endswith("> 0.2")
    assert alerts["PdserveShardCacheHitRatioLow"]["expr"].rstrip().endswith("< 0.95")
    assert 'status=~"5.."' in alerts["PdserveGatewayErrorRate"]["expr"]
    assert {"paramstore_shard_load_seconds_bucket", "paramstore_cache_hits_total", "paramstore_cache_misses_total",
            "pdserve_gateway_requests_total", "pdserve_node_kv_blocks_used"} <= used  # fmt: skip


def test_grafana_dashboard_has_the_three_rows_and_parses():
    """Its queries evaluated against a real Prometheus over `pdserve up`: tests/deploy/test_observability.py."""
    dash = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Resources", "Prefill latency / decode throughput / KV transfer", "QPS, P99 latency, error rate"]
    used, ids = set(), [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        for t in p.get("targets", []):
            used |= metric_names(t["expr"])
    assert CADVISOR <= used
    assert {"pdserve_node_ttft_seconds_bucket", "pdserve_node_tpot_seconds_bucket", "pdserve_node_kv_blocks_used",
            "pdserve_gateway_requests_total"} <= used  # fmt: skip


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity)
    return float(m[1]) * units.get(m[2], 1)


def test_node_pods_are_standby_runtimes_within_their_memory_limit(overlay):
    """No model is bound to a node pod (the autoscaler's pool places them; tests/deploy/test_pods.py runs it),
    and the memory budget of the models a pod holds is set below the pod's limit (MemAvailable is the host's)."""
    (cm,) = objects(overlay, "ConfigMap").values()
    cfg = tomllib.loads(cm["data"]["pdserve.toml"])
    assert "model" not in cfg.get("node", {}), "a [node] model binds every node pod to it"
    assert cfg["gateway"]["models"] and "model" not in cfg["gateway"]
    for role in NODE_ROLES:
        c = container(objects(overlay, "Deployment")[f"pdserve-{role}"])
        assert "--model" not in c["args"]
        assert 0 < cfg["node"]["memory_gb"] * 1e9 < 0.9 * _bytes(c["resources"]["limits"]["memory"]), role


def test_the_admission_policy_names_the_autoscaler_as_it_is_deployed(overlay):
    """The policy narrowing the autoscaler's pod patches (run on the API twin by
    tests/autoscaler/test_kubernetes_rbac.py) matches the service account the autoscaler's pods run as, in
    the namespace the overlay deploys to, and is bound to deny."""
    (policy,) = objects(overlay, "ValidatingAdmissionPolicy").values()
    (binding,) = objects(overlay, "ValidatingAdmissionPolicyBinding").values()
    dep = objects(overlay, "Deployment")["pdserve-autoscaler"]
    who = f"system:serviceaccount:{dep['metadata']['namespace']}:{pod_spec(dep)['serviceAccountName']}"
    assert [c["expression"] for c in policy["spec"]["matchConditions"]] == [f"request.userInfo.username == '{who}'"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
