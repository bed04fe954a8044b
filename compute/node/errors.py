"""A node's refusals, named by what the caller should do; each carries the ``kind`` of its ``NodeError`` body
(compute/node/protocol.py ``STATUS``: 400 for a bad request, 503 for the others: retry elsewhere)."""

from __future__ import annotations


class BadNodeRequest(ValueError):
    """The request itself is invalid (HTTP 400): retrying elsewhere will not help."""

    kind = "bad_request"


class NodeBusy(Exception):
    """The node cannot take the request now (draining, cache full): HTTP 503, retry elsewhere."""

    kind = "overloaded"


class ModelNotLoaded(NodeBusy):
    """The model named is not held (or not ready) here: HTTP 503, retry on a node that holds it."""

    kind = "model_not_loaded"


class TransferFailed(NodeBusy):
    """The KV could not be offered or pulled: HTTP 503, re-prefill on a healthy pair."""

    kind = "transfer_failed"
