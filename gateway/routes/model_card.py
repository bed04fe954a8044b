"""``GET /v1/models/{model}``: one served model's card (OpenAI's shape), with what pdserve knows of its
load as extra fields clients that do not know them ignore:

  max_model_len       its context, in tokens (null: its bundle not read yet)
  nodes_ready         nodes that hold it ready to serve now
  nodes_loading       nodes loading it now
  parent, root        an adapter's base model and its version (vLLM's fields); a model: null and its name
  servable_from_zero  a request for it is held while it is placed when no node holds it (an activator:
                      ``pdserve up``, the autoscaler); false: such a request is a 503 after the queue timeout

A model this gateway does not serve is a 404 in OpenAI's error shape (code ``model_not_found``).
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.openapi import errors
from gateway.api.protocol import ModelCard, error_response
from gateway.models import UnknownModel


class ServedModelCard(ModelCard):
    max_model_len: int | None
    nodes_ready: int
    nodes_loading: int
    servable_from_zero: bool


def listed(name: str, text) -> dict:
    """A name's entry in ``/v1/models``: an adapter names its base as ``parent`` and its version as ``root``."""
    adapter = text is not None and text.adapter is not None
    return {"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
            "parent": text.routed if adapter else None, "root": text.adapter.ref if adapter else name}  # fmt: skip


def card(gw, name: str) -> dict:
    text = gw.models.loaded().get(name)
    routed = text.routed if text is not None else name  # an adapter runs on its base's nodes
    nodes = gw.registry.nodes.values()
    ready = sum(1 for n in nodes if n.view(routed).ready)
    loading = sum(1 for n in nodes if n.healthy and n.held_models().get(routed) == "loading")
    return listed(name, text) | {"max_model_len": text.max_model_len if text is not None else None,
                                 "nodes_ready": ready, "nodes_loading": loading,
                                 "servable_from_zero": gw.activator.activate is not None}  # fmt: skip


def model_card_router(gw) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models/{model}", response_model=ServedModelCard, responses=errors(401, 404))
    async def retrieve(model: str):
        try:
            await gw.models.text(model)
        except UnknownModel as e:
            return error_response(404, str(e), "not_found_error", "model", "model_not_found")
        except Exception:  # noqa: BLE001 - its bundle unreadable now: the card without what the bundle tells
            pass
        return card(gw, model)

    return router
