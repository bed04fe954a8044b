"""Relay: a decode node that starts draining while the prefill runs gets no decode request; the KV
handle goes to another ready decode node instead (no failed attempt, no re-prefill)."""

from __future__ import annotations

import asyncio

from compute.engine.sampling import SamplingParams
from compute.kv_transfer.handle import FakeHandle
from compute.node.protocol import PrefillReply, StreamLine
from gateway.routing.registry import Sending
from gateway.routing.relay import GenRequest, Relay
from gateway.routing.router import NodeView


class Registry:
    def __init__(self, views):
        self.v = {x.url: x for x in views}

    def views(self, model=None):
        return list(self.v.values())

    def suspect(self, url):
        pass

    def sending(self, url, model, tokens=0, streams=0):
        return Sending(None, model, tokens, streams)  # no load correction in this twin

    async def wait_changed(self, timeout):
        await asyncio.sleep(timeout)


class Client:
    def __init__(self, registry, drain_during_prefill: str | None):
        self.registry, self.drain, self.calls = registry, drain_during_prefill, []

    async def prefill(self, url, body):
        self.calls.append(("prefill", url))
        if self.drain:  # scale-down begins meanwhile: the gateway marks the node draining
            old = self.registry.v[self.drain]
            self.registry.v[self.drain] = NodeView(old.url, old.role, draining=True, kv_blocks_free=old.kv_blocks_free)
        kv = FakeHandle(request_id="r", layout={}, num_tokens=1, num_blocks=1, nbytes=0, wire_nbytes=0, codec="none",
                        expires_at=0.0, address="fake://prefill")  # fmt: skip
        return PrefillReply([7], None, kv=kv)

    async def decode(self, url, body):
        self.calls.append(("decode", url))
        yield StreamLine([8, 9], "length")

    async def abort(self, url, rid):
        self.calls.append(("abort", url))


def _run(drain):
    reg = Registry([NodeView("p", "prefill"), NodeView("d1", "decode", kv_blocks_free=10),
                    NodeView("d2", "decode", kv_blocks_free=5)])  # fmt: skip
    client = Client(reg, drain)
    relay = Relay(reg, client, retry_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
    req = GenRequest("r", [1, 2, 3], 3, SamplingParams(temperature=0), deadline=1e18)

    async def go():
        return [(t.token_ids, t.finish_reason) async for t in relay.run(req)]

    out = asyncio.run(go())
    return out, client.calls, req


def test_decode_node_draining_during_prefill_is_not_used():
    out, calls, req = _run(drain="d1")
    assert out == [([7], None), ([8, 9], "length")]
    assert calls == [("prefill", "p"), ("decode", "d2")]
    assert req.attempts == 0 and req.route.decode == "d2"


def test_decode_node_still_live_is_kept():
    _, calls, req = _run(drain=None)
    assert calls == [("prefill", "p"), ("decode", "d1")]
    assert req.attempts == 0
