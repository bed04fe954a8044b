"""Real processes for end-to-end tests: nodes and gateways on 127.0.0.1, always stopped.

A thin layer over ``compute.node.launcher`` with the tests' fixed internal token.
"""

from __future__ import annotations

import time

from compute.node.launcher import ServiceProc, Services

TOKEN = "test-internal-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
Proc = ServiceProc


def start_node(tmp, store: list[str], model: str, role: str, transport: str = "tcp", threads: int = 1,
               extra: tuple[str, ...] = ()) -> ServiceProc:  # fmt: skip
    return Services(store, model, str(tmp), TOKEN).node(role, threads, transport, kv_blocks=512, extra=extra)


def start_gateway(tmp, store: list[str], model: str, nodes: list[tuple[str, ServiceProc]],
                  extra: tuple[str, ...] = (), env: dict | None = None) -> ServiceProc:  # fmt: skip
    return Services(store, model, str(tmp), TOKEN).gateway(nodes, extra, env)


def wait_blocks_free(nodes: list[ServiceProc], timeout: float = 10.0) -> list[dict]:
    """Poll until every node reports no used/held KV blocks and no active requests (or time out)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [n.load() for n in nodes]
        if all(ld["kv_blocks_used"] == 0 and ld["active_requests"] == 0 for ld in loads):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.1)
