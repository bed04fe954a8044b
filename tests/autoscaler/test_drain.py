"""Scale-down drains, with the real LocalActuator (`pdserve node` processes) and the gateway's own
registry, router and relay (autoscaler/up.py's registry hooks) on the tiny model (token ids only).

- `scale(role, n - 1)` while N streams are in flight on the newest node: the gateway stops
  routing to it before the drain starts, every in-flight stream completes in full, requests sent
  meanwhile all go to the other node (none refused, none retried), the node frees its KV blocks
  and exits, and `current()` no longer lists it.
- A node process that dies on its own is dropped by `current()` (and deregistered).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import types

import httpx
import pytest

from compute.engine.sampling import SamplingParams
from compute.node.auth import SignedAuth
from tests.services import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TOKEN = "drain-test-token"
AUTH = SignedAuth(TOKEN)
STREAMS = 4
MAX_TOKENS = 200  # the tiny model's context is 256
DRAIN_TIMEOUT_S, STOP_TIMEOUT_S = 30, 5  # the actuator's bounds on a drain and on a process's exit


def _actuator(tmp_path, tiny_model_store, **hooks):
    from autoscaler.local import LocalActuator, LocalConfig

    locations, name = tiny_model_store
    cfg = LocalConfig(model=name, store=list(locations), internal_token=TOKEN, threads=1, kv_blocks=256,
                      log_dir=str(tmp_path / "logs"), ready_timeout_s=60, drain_timeout_s=DRAIN_TIMEOUT_S,
                      stop_timeout_s=STOP_TIMEOUT_S)  # fmt: skip
    return LocalActuator(cfg, **hooks)


def _load(url: str) -> dict:
    return httpx.get(url + "/load", auth=AUTH, timeout=5).json()


def test_scale_down_drains_without_losing_a_request(tmp_path, tiny_model_store):
    from autoscaler.up import registry_hooks
    from gateway.routing.nodes import NodeClient
    from gateway.routing.registry import NodeRegistry
    from gateway.routing.relay import GenRequest, Relay

    seen: dict[str, dict] = {}  # what the leaving node reported when the drain began / when it was done
    drain_started = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        registry = NodeRegistry(TOKEN, interval_s=0.2, failures=2)
        client = NodeClient(TOKEN, timeout_s=30)
        relay = Relay(registry, client, retry_attempts=3, backoff_base_s=0.05, backoff_max_s=0.2)
        hooks = registry_hooks(types.SimpleNamespace(registry=registry), loop)

        def on_draining(node):
            hooks["on_draining"](node)  # the gateway stops routing to it (waits for the loop)
            seen["drain_start"] = _load(node.url) | {"routable": registry.nodes[node.url].view().routable}
            drain_started.set()

        def on_gone(node):  # called after the drain returned, before SIGTERM: the process still answers
            try:
                seen["gone"] = _load(node.url)
            except httpx.HTTPError as e:
                seen["gone"] = {"error": str(e)}
            hooks["on_gone"](node)

        act = _actuator(tmp_path, tiny_model_store, on_ready=hooks["on_ready"], on_draining=on_draining,
                        on_gone=on_gone)  # fmt: skip
        await registry.start()
        try:
            act.scale("both", 1)
            await until(lambda: len(registry.nodes) == 1 and registry.views()[0].routable, 60, "node A routable")
            old = next(iter(registry.nodes))
            act.scale("both", 2)
            await until(lambda: sum(v.routable for v in registry.views()) == 2, 60, "node B routable")
            (new,) = [u for u in registry.nodes if u != old]
            assert sorted(n.url for n in act.current()["both"]) == sorted([old, new])

            async def run(rid: str, max_tokens: int) -> tuple[GenRequest, int, str | None]:
                req = GenRequest(rid, [5 + i % 200 for i in range(8)], max_tokens,
                                 SamplingParams(temperature=0, ignore_eos=True), deadline=time.monotonic() + 30)  # fmt: skip
                got, reason = [], None
                async for line in relay.run(req):
                    got += line.token_ids
                    reason = line.finish_reason or reason
                return req, len(got), reason

            # N long streams on the newest node (B): the router is steered there by marking A draining
            registry.mark_draining(old)
            inflight = [asyncio.create_task(run(f"long{i}", MAX_TOKENS)) for i in range(STREAMS)]
            await until(lambda: _load(new)["active_requests"] == STREAMS, 20, "streams in flight on B")
            registry.nodes[old].draining = False
            await registry.poll_once()

            t_drain = time.monotonic()
            act.scale("both", 1)  # drains the newest node: B
            assert [n.url for n in act.current()["both"]] == [old], "the leaving node is no longer counted"
            await until(drain_started.is_set, 10, "the drain to start")
            during = [await run(f"new{i}", 8) for i in range(6)]  # sent while B drains

            done = await asyncio.gather(*inflight)
            await until(lambda: new not in registry.nodes, 30, "B deregistered")
            proc = [p for p in act.nodes if p.url == new]
            await until(lambda: not proc or proc[0].proc.poll() is not None, 15, "B's process to exit")
            drained_s = time.monotonic() - t_drain
            return done, during, old, new, drained_s
        finally:
            act.close()
            await registry.stop()
            await client.close()

    done, during, old, new, drained_s = asyncio.run(scenario())

    # the drain began while the streams were in flight, and the gateway had already stopped routing to B
    assert seen["drain_start"]["active_requests"] == STREAMS, seen
    assert seen["drain_start"]["routable"] is False, seen
    # every in-flight stream completed in full, on B, without a retry
    for req, n, reason in done:
        assert (n, reason) == (MAX_TOKENS, "length")
        assert req.route.both == new and req.attempts == 0
    # nothing new was routed to the draining node (none refused and retried elsewhere)
    for req, n, reason in during:
        assert (n, reason) == (8, "length")
        assert req.route.both == old and req.attempts == 0, (req.route, req.attempts)
    # B finished its work and freed its KV blocks before it was stopped
    assert seen["gone"].get("active_requests") == 0, seen
    assert seen["gone"]["kv_blocks_used"] == 0, seen
    assert seen["gone"]["draining"] is True
    # bounded by what the actuator promises (drain, then stop), not by a figure fitted to one machine; the
    # streams completing in full (above) shows the drain ended with them, not at its timeout
    assert drained_s < DRAIN_TIMEOUT_S + STOP_TIMEOUT_S, drained_s


def test_node_that_dies_on_its_own_is_dropped(tmp_path, tiny_model_store):
    gone: list[str] = []
    ready = threading.Event()
    act = _actuator(tmp_path, tiny_model_store, on_ready=lambda n: ready.set(), on_gone=lambda n: gone.append(n.url))
    try:
        (p,) = [act.start("both")]
        assert ready.wait(60), "node not ready"
        assert [(n.url, n.ready) for n in act.current()["both"]] == [(p.url, True)]
        os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)
        assert act.current() == {}
        assert gone == [p.url]
        assert act.replicas("both") == 0
        act.scale("both", 1)  # the control loop's next tick would start a replacement
        assert len(act.current()["both"]) == 1 and act.current()["both"][0].url != p.url
    finally:
        act.close()
    assert p.proc.poll() is not None and act.current() == {}
