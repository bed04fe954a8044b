"""A separate autoscaler's registrations made to match the nodes it runs (``GatewayClient.reconcile``), against a
real `pdserve gateway` and a real node: a node whose registration was lost is registered again, a dead node the
gateway still lists as the autoscaler's is deregistered, and neither is sent twice within ``RESEND_S``.
tests/net/test_autoscaler_partition.py drills the partition that loses them."""

from __future__ import annotations

import httpx
import pytest

from autoscaler.actuator import NodeInfo
from autoscaler.observer import RESEND_S, GatewayClient
from compute.node.launcher import Services, free_port
from tests.services import AUTH, TOKEN, wait_for

pytestmark = pytest.mark.slow


def _listed(gw) -> dict[str, str]:
    return {n["url"]: n["source"] for n in httpx.get(gw.url + "/internal/status", auth=AUTH, timeout=5).json()["nodes"]}


def test_a_lost_registration_is_sent_again_and_a_dead_node_leaves(tmp_path, tiny_model_store):
    locations, model = tiny_model_store
    svc = Services(locations, model, str(tmp_path), TOKEN)
    client = None
    try:
        node = svc.node("both", kv_blocks=64)
        gw = svc.gateway([])
        node.wait_ready()
        gw.wait_ready(60, path="/health")
        client = GatewayClient([gw.url], TOKEN)
        dead = f"http://127.0.0.1:{free_port()}"  # a node that ended while its deregistration could not be sent
        client.register(NodeInfo("both", dead, ready=True))
        assert _listed(gw) == {dead: "autoscaler"}
        ours = [NodeInfo("both", node.url, ready=True), NodeInfo("decode", "http://127.0.0.1:1", ready=False)]
        assert client.reconcile(ours, now=100.0) == []  # no snapshot read yet: nothing known to differ
        client.status()
        assert sorted(client.reconcile(ours, now=100.0)) == sorted([node.url, dead])  # (a node not ready: not yet)
        wait_for(lambda: _listed(gw) == {node.url: "autoscaler"}, 20, "the node registered, the dead one gone")
        client.deregister(ours[0])  # lost again at once: not resent within RESEND_S, resent after it
        client.status()
        assert client.reconcile(ours, now=100.0 + RESEND_S / 2) == []
        assert client.reconcile(ours, now=100.0 + RESEND_S) == [node.url]
        wait_for(lambda: _listed(gw) == {node.url: "autoscaler"}, 20, "the node registered again")
        client.status()
        assert client.reconcile(ours, now=200.0) == []  # matching: nothing sent
    finally:
        if client is not None:
            client.close()
        svc.stop_all()
