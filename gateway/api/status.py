"""``GET /internal/status`` as types: what one gateway knows about load, defined once.

Written by the gateway (gateway/routes/internal.py ``snapshot``), read by the autoscaler (autoscaler/observer.py:
over HTTP from `pdserve autoscale`, in-process under `pdserve up`), merged over gateway replicas there, and shown by
`pdserve status`. On the wire it is JSON with every field present; ``read`` takes that JSON's data (or a snapshot
as it is) and gives the typed status, with the defaults below for what a reader does not find.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from compute.node.protocol import LoadReport


class ModelTraffic(msgspec.Struct, kw_only=True):
    """One model's traffic at the gateway (gateway/admission/traffic.py): the autoscaler's demand signal."""

    queue_depth: int = 0  # waiting for admission + held
    held: int = 0  # held by the activator: no node holds the model ready
    running: int = 0
    queue_wait_p99_s: float = 0.0  # over the last minute (0: no sample)
    ttft_p99_s: float = 0.0
    tpot_p99_s: float = 0.0
    requests: int = 0  # since start
    last_request_t: float | None = None  # wall clock
    idle_s: float = 0.0  # since the last request arrived or finished
    requests_per_s: float = 0.0  # arrivals over the last 1-2 s
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    recent_requests: int = 0  # the arrivals those rates count


class NodeEntry(msgspec.Struct, kw_only=True):
    """One node of the gateway's registry: its state as the gateway sees it and its last /load."""

    url: str
    role: str
    state: str = "ready"  # unproven | unhealthy | draining | the node's own (standby, loading, ready)
    models: dict[str, str] = {}  # model -> its state on the node
    load: LoadReport = msgspec.field(default_factory=LoadReport)
    source: str | None = None


class GatewayStatus(msgspec.Struct, kw_only=True):
    """The whole snapshot; ``gateways``: how many replicas' snapshots it merges."""

    t: float = 0.0
    model: str | None = None  # the gateway's default model
    queue_depth: int = 0
    running: int = 0
    queue_wait_p99_s: float = 0.0
    held: int = 0
    served: list[str] = []
    models: dict[str, ModelTraffic] = {}
    nodes: list[NodeEntry] = []
    autoscaler: dict | None = None  # the last report the autoscaler published
    prefix_index: dict | None = None
    gateways: int = 1


def read(status: GatewayStatus | Mapping) -> GatewayStatus:
    """The typed status of a snapshot or of its JSON data; ``msgspec.ValidationError`` (a ValueError) naming
    the field that is not what it should be."""
    if isinstance(status, GatewayStatus):
        return status
    return msgspec.convert(status, GatewayStatus, strict=False)
