"""KV-cache transfer between prefill and decode nodes: contract, backends (nixl, tcp, fake), codecs.

The engine allocates its cache as a ``KVPool`` (one tensor
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``), then::

    sender = make_transfer("nixl", "prefill", layout, pool, on_release=free_blocks)
    handle = sender.offer(request_id, block_ids, num_tokens)       # -> a KVHandle (msgspec, JSON on the wire)
    receiver = make_transfer("nixl", "decode", layout, pool)
    tid = receiver.start(handle, dst_block_ids); receiver.poll(tid)  # -> TransferState

See ``base`` for the lifecycle and the error contract.
"""

from compute.kv_transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferFailed,
    TransferState,
    TransferStats,
    TransportDead,
    wait,
)
from compute.kv_transfer.compression import CODECS, get_codec
from compute.kv_transfer.factory import TransferConfig, make_transfer
from compute.kv_transfer.handle import AnyHandle, KVHandle
from compute.kv_transfer.layout import KVLayout, KVPool

__all__ = [
    "AnyHandle",
    "KVHandle",
    "CODECS",
    "KVLayout",
    "KVPool",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferConfig",
    "TransferFailed",
    "TransferState",
    "TransferStats",
    "TransportDead",
    "get_codec",
    "make_transfer",
    "wait",
]
