"""The KV handle: what a sender's ``offer`` returns and a receiver ``start``s from, one typed Struct per backend.

It travels as JSON over the node API (msgspec, tagged by ``backend``), is checked by its type when it is
decoded, and is read by attribute everywhere: nothing extends or validates it by hand.

Layout::

    every backend   version, request_id, layout (KVLayout.to_dict), num_tokens, num_blocks,
                    nbytes (raw KV), wire_nbytes (as sent, after the codec), codec, expires_at (wall clock)
    the node's      block_hashes (an export's blocks, named by content; bytes: base64 in JSON),
                    cacheable_blocks (the leading blocks a prefill computed: a decode node may cache those)
    tcp             address [host, port], secret (one per offer: the stream's password)
    nixl            agent, metadata (the sender agent's, bytes), sender, region (BlockRegion), blocks
    fake            address ("fake://...": the in-process registry's key)
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlsplit

import msgspec

from compute.kv_transfer.layout import BlockRegion

HANDLE_VERSION = 1


class KVHandle(msgspec.Struct, kw_only=True, tag_field="backend", forbid_unknown_fields=True, omit_defaults=True):
    backend: ClassVar[str] = "?"

    version: int = HANDLE_VERSION
    request_id: str
    layout: dict[str, Any]
    num_tokens: int
    num_blocks: int
    nbytes: int
    wire_nbytes: int
    codec: str
    expires_at: float
    block_hashes: list[bytes] = []
    cacheable_blocks: int = 0

    def __post_init__(self):
        if self.num_blocks < 1 or self.num_tokens < 1 or self.nbytes < 0 or self.wire_nbytes < 0:
            raise ValueError("a KV handle names at least one block and token and no negative size")
        if self.block_hashes and len(self.block_hashes) != self.num_blocks:
            raise ValueError(f"{len(self.block_hashes)} block_hashes for {self.num_blocks} blocks")
        if not 0 <= self.cacheable_blocks <= self.num_blocks:
            raise ValueError(f"cacheable_blocks {self.cacheable_blocks} out of [0, {self.num_blocks}]")

    def reachable_from(self, sender_url: str) -> KVHandle:
        """The handle as a receiver should dial it, the sender reached at ``sender_url`` (itself: nothing to dial)."""
        return self

    def share(self, k: int) -> int:
        """Raw bytes of the handle's last ``num_blocks - k`` blocks (what a receiver holding ``k`` pulls)."""
        return self.nbytes * (self.num_blocks - k) // self.num_blocks


class TcpHandle(KVHandle, tag="tcp"):
    backend: ClassVar[str] = "tcp"

    address: tuple[str, int]
    secret: str

    def reachable_from(self, sender_url: str) -> TcpHandle:
        """A sender listening on every interface (0.0.0.0 in a pod) offers its KV at that wildcard address, which
        means "this host" to whoever dials it: dial the host the sender was reached at instead."""
        host, port = self.address
        if host in ("0.0.0.0", "::", ""):
            return msgspec.structs.replace(self, address=(urlsplit(sender_url).hostname, port))
        return self


class NixlHandle(KVHandle, tag="nixl"):
    backend: ClassVar[str] = "nixl"

    agent: str
    metadata: bytes
    sender: str
    region: BlockRegion
    blocks: list[int]


class FakeHandle(KVHandle, tag="fake"):
    backend: ClassVar[str] = "fake"

    address: str


AnyHandle = TcpHandle | NixlHandle | FakeHandle
