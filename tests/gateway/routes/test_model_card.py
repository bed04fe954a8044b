"""GET /v1/models/{model}'s load state, from the registry as the gateway sees it (no processes): nodes that
hold the model ready, nodes loading it, and whether a request for it is held while it is placed."""

from __future__ import annotations

from compute.node import protocol as P


def test_card_counts_ready_and_loading_nodes_and_says_whether_it_is_servable_from_zero():
    from gateway.config import GatewayConfig
    from gateway.models import ModelCatalogue
    from gateway.routes.model_card import card
    from gateway.service import Gateway

    gw = Gateway(GatewayConfig(models=["a", "b"]), ModelCatalogue(None, ["a", "b"]))
    loads = {"http://n1": {"a": "ready", "b": "loading"}, "http://n2": {"a": "ready"}, "http://n3": {"a": "loading"},
             "http://n4": {"a": "ready"}}  # fmt: skip
    for url, models in loads.items():
        n = gw.registry.add(url, "both")
        n.load = P.LoadReport(state="ready", ready=True, models={m: P.ModelLoad(model=m, state=s)
                                                                for m, s in models.items()})
        n.proven, n.healthy = True, url != "http://n4"  # n4 failed its health checks: holds nothing servable
    a = card(gw, "a")
    assert (a["id"], a["object"], a["owned_by"], a["max_model_len"]) == ("a", "model", "pdserve", None)
    assert (a["nodes_ready"], a["nodes_loading"], a["servable_from_zero"]) == (2, 1, False)
    assert (card(gw, "b")["nodes_ready"], card(gw, "b")["nodes_loading"]) == (0, 1)
    gw.activate = lambda model: None  # pdserve up / the autoscaler: a held request is placed
    assert card(gw, "b")["servable_from_zero"] is True
