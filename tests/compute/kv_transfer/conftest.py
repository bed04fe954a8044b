"""KV transfer tests: small layouts, real child processes (spawn), bounded waits.

UCX / NIXL read their environment when the first agent is created; the library
never sets it, the test process does (children inherit it).
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"  # else UCX also listens on eth0
os.environ["NIXL_LOG_LEVEL"] = "WARN"
os.environ.pop("UCX_TLS", None)

import pytest
import torch

from compute.kv_transfer import KVLayout
from tests.compute.kv_transfer.peer import Peer, have_nixl

LAYOUT = KVLayout(num_layers=3, block_size=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [3, 7, 9], [0, 1, 5], 10  # 10 tokens -> 3 blocks of 4


@pytest.fixture(scope="session")
def layout():
    return LAYOUT


@pytest.fixture(scope="session")
def peer():
    """A prefill process serving tcp, nixl and nixl+int8 senders over one random cache."""
    senders = {"tcp": {"backend": "tcp"}}
    if have_nixl():
        senders |= {"nixl": {"backend": "nixl"}, "nixl-int8": {"backend": "nixl", "compression": "int8"}}
    p = Peer.spawn(LAYOUT, senders, seed=1)
    yield p
    p.stop()
