"""The autoscaler believes and commands only what proves the internal token at its own URL (compute/node/auth.py
``Prover``): a gateway's status is read, a node's /load read and the node claimed, only after the peer answered
the challenge. A plain HTTP server in their place (a pod wearing the gateway's labels, a squatter on a dead
node's address: tests/rogue.py) gets the challenge and nothing else, against a real gateway and a real node."""

from __future__ import annotations

import pytest

from autoscaler.actuator import Actuator, NodeInfo, TemporaryActuatorError
from autoscaler.observer import GatewayClient
from autoscaler.pool import PoolConfig, RuntimePool
from compute.node.launcher import Services
from tests.rogue import Rogue
from tests.services import TOKEN, wait_for

pytestmark = pytest.mark.slow


class Listed(Actuator):
    """A runtime actuator twin that lists the given nodes as running (as EndpointSlices would) and starts none."""

    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes

    def current(self) -> dict[str, list[NodeInfo]]:
        return {"both": list(self.nodes)}

    def scale(self, role: str, replicas: int, prefer_remove: tuple[str, ...] = ()) -> None:
        pass


def test_an_impostor_gateway_or_node_gets_the_challenge_and_nothing_else(tmp_path, tiny_model_store):
    locations, model = tiny_model_store
    svc = Services(locations, None, str(tmp_path), TOKEN)
    rogue, client, pool = Rogue(), None, None
    try:
        node = svc.node("both", kv_blocks=64)
        gw = svc.gateway([])
        node.wait_ready()
        gw.wait_ready(60, path="/health")

        client = GatewayClient([rogue.url, gw.url], TOKEN)
        client.status()  # the real gateway's snapshot; the impostor's made-up answers are never asked for
        assert client.urls == [gw.url]
        client.register(NodeInfo("both", node.url, ready=True))
        client.publish({"actuator": "test"})
        with pytest.raises(TemporaryActuatorError, match="proved"):
            GatewayClient([rogue.url], TOKEN).status()

        pool = RuntimePool(Listed([NodeInfo("both", rogue.url, ready=True), NodeInfo("both", node.url, ready=True)]),
                           TOKEN, PoolConfig(pool_size=0, max_runtimes={"both": 2}), roles=("both",))  # fmt: skip
        pool.scale((model, "both"), 2)  # two wanted: only the proven node can take one
        ready = wait_for(lambda: [n.url for n in pool.current().get((model, "both"), []) if n.ready], 60,
                         "the model ready on the real node")  # fmt: skip
        assert ready == [node.url]
        assert pool.view[rogue.url].state == "unproven"

        assert rogue.seen and {s["path"] for s in rogue.seen} == {"/prove"}, rogue.seen
        assert not rogue.leaked()  # no signature, no token, no body but the challenge
    finally:
        for c in (client, pool):
            if c is not None:
                c.close()
        rogue.close()
        svc.stop_all()
