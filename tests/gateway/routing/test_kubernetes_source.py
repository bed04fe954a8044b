"""The gateway's node registry source from Kubernetes (gateway/routing/discovery.py ``KubernetesSource``) against
the API twin (tests/kubeapi.py): it lists each role's EndpointSlices, then watches them (list + watch: what the
gateway's Role in deploy/base grants), follows scale-ups, terminations and deleted slices, re-lists after a
watch ends or a list fails, and stops its watch threads at once.

  GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...[&watch=true&resourceVersion=...]
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests import kubeapi
from tests.services import until

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed")

from gateway.routing.discovery import DiscoveryConfig, KubernetesSource
from gateway.routing.registry import NodeRegistry

NS = kubeapi.CONTRACT_NS


def endpoint_slice(service: str, suffix: str, endpoints: list[tuple[str, bool | None, bool, str]]) -> dict:
    return kubeapi.endpoint_slice(service, suffix, endpoints, NS)


@pytest.fixture
def api():
    server = kubeapi.contract_twin()
    yield server
    server.close()


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
        slices = [r for r in api.requests if kubeapi.SLICES.match(r["path"])]
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
        statuses = [r for r in api.requests if kubeapi.SLICES.match(r["path"]) and "watch" not in r["query"]]
        assert len(statuses) >= 3  # failed list, first list, re-list

    asyncio.run(run())


def test_gateway_discovery_mode_auto_means_kubernetes_only_inside_a_pod():
    assert DiscoveryConfig().resolved_mode({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == "kubernetes"
    assert DiscoveryConfig().resolved_mode({}) == "static"
    assert DiscoveryConfig(mode="kubernetes").resolved_mode({}) == "kubernetes"
    with pytest.raises(ValueError, match="invalid gateway discovery mode"):
        DiscoveryConfig(mode="dns")
