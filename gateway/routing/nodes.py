"""The gateway's node client: ``compute.node.client.AsyncNodeClient`` (routes, signing, error mapping).

The node API's messages are defined once, in compute/node/protocol.py. A stream line is a
``StreamLine`` (token ids, finish reason null | stop | length | abort | error, logprobs, error);
``GenerateRequest.replay_tokens``: after a failover the prompt ends with tokens already streamed; the
node recomputes them one per step, as the lost decode did, so greedy output continues
bit-identically (prefill-sized matmuls take another kernel and can flip near-ties).
"""

from __future__ import annotations

from compute.node.client import AsyncNodeClient as NodeClient
from compute.node.client import NodeFailed, RequestRejected

__all__ = ["NodeClient", "NodeFailed", "RequestRejected"]
