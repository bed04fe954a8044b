"""Real processes for end-to-end tests: nodes and gateways on 127.0.0.1, always stopped.

A thin layer over ``compute.node.launcher`` with the tests' fixed internal token, and the one bounded
poll the tests wait with (``wait_for``; ``until`` in a coroutine).

Tests that compare numbers (greedy text, token ids, logprobs) between two requests, two nodes, a request
alone and in a batch, colocated and split, before and after a failover, start their nodes with
``kernels="invariant"``: under the default ``measured`` plan a request's numbers may depend on its batch
(the fastest kernel differs per batch size on some CPUs, by design) and on when the node swapped in its
measured plan (``compute/kernels/plans.py``). The helpers then wait until every node runs its final plan
(``wait_kernels_settled``) before the first request: a node under ``invariant`` keeps the plan it served
its first request with, and two nodes compared must run the same one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from compute.node.auth import SignedAuth
from compute.node.launcher import ServiceProc, Services

TOKEN = "test-internal-token"
AUTH = SignedAuth(TOKEN)
Proc = ServiceProc


INVARIANT = ("--kernels", "invariant")  # `pdserve node` flags: one row-invariant int8 kernel per shape at every M
PLAN_PENDING = ("waiting", "measuring")  # compute.kernels.plans.BackgroundMeasure.state while a plan may still come


def admin_headers(url: str) -> dict[str, str]:
    """The admin key `pdserve up` wrote for the gateway at `url` (gateway/keyfile.py), as `pdserve status` reads it."""
    from gateway import keyfile

    key = keyfile.read(url)  # none yet while `pdserve up` starts: no header, a 401
    return {"Authorization": f"Bearer {key}"} if key else {}


def start_node(tmp, store: list[str], model: str, role: str, transport: str = "tcp", threads: int = 1,
               extra: tuple[str, ...] = ()) -> ServiceProc:  # fmt: skip
    return Services(store, model, str(tmp), TOKEN).node(role, threads, transport, kv_blocks=512, extra=extra)


def kernels_settled(node: ServiceProc) -> bool:
    """Whether every model on ``node`` runs its final int8 kernel plan: loaded, no measurement pending (its own
    or another process's), and a measured plan swapped in (the swap runs between two engine steps, just after
    the measurement is done). A plan from the store or the machine's cache is final at once."""
    for m in node.load()["models"].values():
        k = m.get("kernels")
        if m["state"] != "ready" or k is None or k["measure"] in PLAN_PENDING:
            return False
        if k["measure"] == "done" and k["source"] == "rule":
            return False
    return True


def wait_kernels_settled(nodes: list[ServiceProc], timeout: float = 600.0) -> list[dict]:
    """Until every node runs its final kernel plan (``kernels_settled``), then that they all run the same one:
    this machine's measured table (from the store, the cache, another process or their own measurement), or
    all the safe rule; -> each node's kernel state per model.

    Call it before a node serves its first request: under ``kernels = invariant`` a node that has served keeps
    its plan. ``timeout`` bounds a first measurement on a slow CPU (~72 s on an AVX2 box, the nodes idle)."""
    for n in nodes:
        wait_for(lambda n=n: kernels_settled(n), timeout, f"{n.name}'s final kernel plan", every=0.25)
    states = [{name: m["kernels"] for name, m in n.load()["models"].items()} for n in nodes]
    sources = {k["source"] == "rule" for s in states for k in s.values() if k["source"]}  # "": no int8 weights
    assert len(sources) <= 1, f"the nodes compared run different kernel plans: {states}"
    return states


def start_gateway(tmp, store: list[str], model: str, nodes: list[tuple[str, ServiceProc]],
                  extra: tuple[str, ...] = (), env: dict | None = None) -> ServiceProc:  # fmt: skip
    return Services(store, model, str(tmp), TOKEN).gateway(nodes, extra, env)


@contextmanager
def nodes_up(tmp, store: list[str], model: str, specs: dict, invariant: bool = False) -> Iterator[dict]:
    """{key: (role, transport, *extra args)} -> {key: ready node}; every node started is stopped on exit.

    ``invariant``: every node runs ``--kernels invariant`` and is yielded once its plan is final (for tests that
    compare numbers: the module docstring)."""
    nodes = {}
    try:
        for key, (role, transport, *extra) in specs.items():
            flags = (*extra, *(INVARIANT if invariant else ()))
            nodes[key] = start_node(tmp, store, model, role, transport, extra=flags)
        for n in nodes.values():
            n.wait_ready()
        if invariant:
            wait_kernels_settled(list(nodes.values()))
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()


@contextmanager
def running_service(tmp, store: list[str], model: str, roles: list[str], env: dict | None = None,
                    extra: tuple[str, ...] = (), invariant: bool = False) -> Iterator[dict]:  # fmt: skip
    """One node per entry of ``roles`` and a gateway over them, all ready; every one stopped on exit.
    ``invariant``: as ``nodes_up``'s.

    Yields ``{"gw": gateway, "nodes": [nodes in the order of roles], "name": model}``."""
    with nodes_up(tmp, store, model, {i: (role, "tcp") for i, role in enumerate(roles)}, invariant) as nodes:
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


def node_generate(node: ServiceProc, rid: str, ids: list[int], max_tokens: int, **sampling) -> list[int]:
    """A whole request on one node (``/internal/generate``, greedy unless ``sampling`` says otherwise): its tokens."""
    import json

    import httpx

    body = {"request_id": rid, "prompt_token_ids": ids, "params": {"max_tokens": max_tokens, "temperature": 0} | sampling}
    toks = []
    with httpx.stream("POST", node.url + "/internal/generate", json=body, auth=node.auth or AUTH,
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            toks += json.loads(line)["token_ids"]
    return toks


def metric(where, name: str, **labels) -> float:
    """The sum of the samples of metric ``name`` (exactly that name; only those with every label of ``labels``) on
    the ``/metrics`` of ``where``: a URL, or a started process (its ``url``)."""
    import httpx

    text = httpx.get((where if isinstance(where, str) else where.url) + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] == name and all(w in head for w in want):
            total += float(value)
    return total
