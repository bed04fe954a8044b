"""One lazy factory for every transfer backend; one config.

Backends are imported only when used, so a node without nixl-cu12 never
imports it. When ``nixl`` is asked for but cannot be used (not installed,
agent creation fails) and ``fallback`` is on, the factory logs a warning,
counts ``pdserve_kv_transfer_fallbacks_total{from_backend="nixl",to_backend="tcp"}``
and returns the tcp backend: never a silent fallback.

Environment: UCX reads ``UCX_NET_DEVICES`` / ``UCX_TLS`` and NIXL reads
``NIXL_LOG_LEVEL`` when the agent is created. This package never sets them;
the node CLI (and the tests) do, before the first nixl transfer object.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, fields

import torch

from compute.kv_transfer.base import (
    KVReceiver,
    KVSender,
    ReleaseCallback,
    TransportDead,
)
from compute.kv_transfer.compression import CODECS
from compute.kv_transfer.layout import KVLayout, KVPool

log = logging.getLogger(__name__)

# backend name -> (module, sender class, receiver class)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "nixl": ("compute.kv_transfer.nixl", "NixlSender", "NixlReceiver"),
    "tcp": ("compute.kv_transfer.tcp", "TcpSender", "TcpReceiver"),
    "fake": ("compute.kv_transfer.fake", "FakeSender", "FakeReceiver"),
}
ROLES = {"prefill": "sender", "sender": "sender", "decode": "receiver", "receiver": "receiver"}


@dataclass(slots=True)
class TransferConfig:
    backend: str = "tcp"  # nixl | tcp | fake
    host: str = "127.0.0.1"  # tcp: address to listen on, advertised in handles (must be reachable)
    port: int = 0  # tcp: listen port, 0 = any free port
    hold_s: float = 30.0  # sender: hold an offer's blocks this long without confirmation
    timeout_s: float = 10.0  # receiver: FAILED('timeout') after this; must be < hold_s
    compression: str = "none"  # none | bf16 | fp16 | int8 (chosen by the sender, in the handle)
    fallback: bool = True  # nixl unusable -> tcp (logged and counted)
    staging_blocks: int = 256  # nixl + compression: blocks (all layers) of registered staging

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown KV transfer backend {self.backend!r}; choose from {sorted(BACKENDS)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if not 0 < self.timeout_s < self.hold_s:
            raise ValueError(f"need 0 < timeout_s ({self.timeout_s}) < hold_s ({self.hold_s}): a receiver "
                             "must be able to finish before the sender releases")  # fmt: skip
        if self.compression not in CODECS:
            raise ValueError(f"unknown compression {self.compression!r}; choose from {sorted(CODECS)}")
        if self.staging_blocks < 1:
            raise ValueError("staging_blocks must be >= 1")


_FIELDS = {f.name for f in fields(TransferConfig)}


def make_transfer(backend: str, role: str, layout: KVLayout, cache: KVPool | torch.Tensor, *,
                  on_release: ReleaseCallback | None = None, **cfg) -> KVSender | KVReceiver:  # fmt: skip
    """A sender (``role="prefill"``) or receiver (``role="decode"``) of ``backend`` over ``cache``.

    ``cache`` is the engine's ``KVPool`` or its tensor ``[L, 2, NB, BS, KVH, Dh]``.
    ``cfg``: ``TransferConfig`` fields; any other keyword goes to the backend
    class (e.g. ``fail_rate`` of the fake receiver). ``on_release`` (senders):
    called with ``(request_id, block_ids, state)`` when an offer's blocks are free.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, not {role!r}")
    config = TransferConfig(backend=backend, **{k: v for k, v in cfg.items() if k in _FIELDS})
    options = {k: v for k, v in cfg.items() if k not in _FIELDS}
    pool = cache if isinstance(cache, KVPool) else KVPool(layout, cache)
    if pool.layout != layout:
        raise ValueError(f"pool layout {pool.layout} != {layout}")
    try:
        return _build(config, ROLES[role], pool, on_release, options)
    except (ImportError, TransportDead) as e:
        if backend != "nixl" or not config.fallback:
            raise
        from compute.kv_transfer import metrics

        log.warning("KV transfer: nixl unusable (%s); falling back to tcp", e)
        metrics.FALLBACKS.labels("nixl", "tcp").inc()
        config.backend = "tcp"
        return _build(config, ROLES[role], pool, on_release, {})


def _build(config: TransferConfig, side: str, pool: KVPool, on_release, options: dict):
    module, sender, receiver = BACKENDS[config.backend]
    mod = importlib.import_module(module)
    if side == "sender":
        return getattr(mod, sender)(pool, config, on_release=on_release, **options)
    return getattr(mod, receiver)(pool, config, **options)
