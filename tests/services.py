"""Real processes for end-to-end tests: nodes and gateways on 127.0.0.1, always stopped.

A thin layer over ``compute.node.launcher`` with the tests' fixed internal token, and the one bounded
poll the tests wait with (``wait_for``; ``until`` in a coroutine).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def nodes_up(tmp, store: list[str], model: str, specs: dict) -> Iterator[dict]:
    """{key: (role, transport, *extra args)} -> {key: ready node}; every node started is stopped on exit."""
    nodes = {}
    try:
        for key, (role, transport, *extra) in specs.items():
            nodes[key] = start_node(tmp, store, model, role, transport, extra=tuple(extra))
        for n in nodes.values():
            n.wait_ready()
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()


@contextmanager
def running_service(tmp, store: list[str], model: str, roles: list[str], env: dict | None = None,
                    extra: tuple[str, ...] = ()) -> Iterator[dict]:  # fmt: skip
    """One node per entry of ``roles`` and a gateway over them, all ready; every one stopped on exit.

    Yields ``{"gw": gateway, "nodes": [nodes in the order of roles], "name": model}``."""
    with nodes_up(tmp, store, model, {i: (role, "tcp") for i, role in enumerate(roles)}) as nodes:
        gw = start_gateway(tmp, store, model, [(roles[i], n) for i, n in nodes.items()], extra, env)
        try:
            yield {"gw": gw.wait_ready(), "nodes": list(nodes.values()), "name": model}
        finally:
            gw.stop()


def wait_for(fn, timeout: float, what: str, every: float = 0.05):
    """``fn()``'s first truthy value, polled every ``every`` s; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(every)
    return out


async def until(fn, timeout: float, what: str, every: float = 0.05):
    """``wait_for`` inside a coroutine: the event loop runs between polls."""
    deadline = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(every)
    return out


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
