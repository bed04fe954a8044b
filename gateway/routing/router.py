"""Routing policy: a small pure function from node load to a (prefill, decode) pair or a `both` node.

Prefill goes to the node with the fewest queued prompt tokens (it will finish
its queue first); decode goes to the node with the most free KV blocks, the
fewest running streams breaking ties. Only ready, non-draining nodes are
candidates, and nodes a request already failed on are excluded. When no split
pair exists, a `both` node takes the whole request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class NodeView:
    """What the router knows of one node (from its /load)."""

    url: str
    role: str  # prefill | decode | both
    ready: bool = True
    draining: bool = False
    queued_prompt_tokens: int = 0
    running: int = 0
    kv_blocks_free: int = 0

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining


@dataclass(slots=True, frozen=True)
class Route:
    prefill: str | None = None
    decode: str | None = None
    both: str | None = None

    @property
    def split(self) -> bool:
        return self.both is None

    def nodes(self) -> tuple[str, ...]:
        return (self.both,) if self.both else (self.prefill, self.decode)


def prefill_key(n: NodeView):
    return (n.queued_prompt_tokens, n.running, n.url)


def decode_key(n: NodeView):
    return (-n.kv_blocks_free, n.running, n.url)


def pick(nodes: list[NodeView], exclude: frozenset[str] | set[str] = frozenset()) -> Route | None:
    """The route for one request, or None when no node can take it."""
    live = [n for n in nodes if n.routable and n.url not in exclude]
    prefill = [n for n in live if n.role == "prefill"]
    decode = [n for n in live if n.role == "decode"]
    if prefill and decode:
        return Route(prefill=min(prefill, key=prefill_key).url, decode=min(decode, key=decode_key).url)
    both = [n for n in live if n.role == "both"]
    if both:
        return Route(both=min(both, key=lambda n: (n.queued_prompt_tokens, -n.kv_blocks_free, n.running, n.url)).url)
    return None
