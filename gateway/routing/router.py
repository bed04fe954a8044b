"""Routing policy: a small pure function from node load (and each node's cached prefix) to a
(prefill, decode) pair or a `both` node.

A prompt-taking node (prefill, or `both`) is scored by what stands before the request's first token
there, in prefill tokens (``Weights``; how they were chosen: docs/gateway.md, "Routing by cache"):

    cost = queued_prompt_tokens                  the node's queue, computed first
         + (prompt_tokens - hit)                 this prompt, less what its prefix cache holds
         + running * w.running                   decode tokens the running streams add to those steps
         + (w.kv_short if the node lacks free KV blocks for what it must compute)

and the lowest cost wins; ties go to the node with the most free KV blocks, then the fewest running
streams. With no hit anywhere this is least load, and an empty node (one that just joined) is the
cheapest. A decode node is picked by its free KV blocks counting its hit as free (blocks it would not
need), the fewest running streams breaking ties. Conditional disaggregation: when the chosen decode node's
own hit leaves at most ``w.local_tokens`` prompt tokens to compute, it takes the whole request (a ``both``
route: it prefills the few tokens itself), since a pull's fixed cost outweighs recomputing them. Only ready, non-draining nodes are candidates, and
nodes a request already failed on are excluded. When no split pair exists, a `both` node takes the
whole request (one score: it prefills and decodes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NO_HITS: Mapping[str, int] = {}


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
    block_size: int = 16  # tokens per KV block (its cache report's; the node default until one came)

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining


@dataclass(slots=True, frozen=True)
class Weights:
    """What one unit of each load term costs, in prefill tokens (docs/gateway.md says how they were chosen)."""

    running: float = 2.0  # one running stream: its decode tokens in the steps of this prefill (measured 1.7)
    kv_short: float = 4096.0  # the node lacks free KV blocks for what it must compute: it would wait or preempt
    local_tokens: int = 4  # a decode node whose hit leaves at most this many prompt tokens computes them itself
    # (measured: a pull's fixed cost ~5-9 ms vs ~2 ms per recomputed token; 0 turns it off)

    def __post_init__(self) -> None:
        if self.running < 0 or self.kv_short < 0 or self.local_tokens < 0:
            raise ValueError("routing weights must be >= 0")


WEIGHTS = Weights()


@dataclass(slots=True, frozen=True)
class Route:
    prefill: str | None = None
    decode: str | None = None
    both: str | None = None
    hit_tokens: int = 0  # prompt tokens the prompt-taking node's cache is expected to give

    @property
    def split(self) -> bool:
        return self.both is None

    def nodes(self) -> tuple[str, ...]:
        return (self.both,) if self.both else (self.prefill, self.decode)


def prefill_cost(n: NodeView, prompt_tokens: int = 0, hit: int = 0, w: Weights = WEIGHTS) -> float:
    """Prefill tokens before this request's first token on ``n`` (the module's formula)."""
    todo = max(0, prompt_tokens - hit)
    short = w.kv_short if n.kv_blocks_free * n.block_size < todo else 0.0
    return n.queued_prompt_tokens + todo + n.running * w.running + short


def prefill_key(n: NodeView, prompt_tokens: int = 0, hits: Mapping[str, int] = NO_HITS, w: Weights = WEIGHTS):
    return (prefill_cost(n, prompt_tokens, hits.get(n.url, 0), w), -n.kv_blocks_free, n.running, n.url)


def decode_key(n: NodeView, hits: Mapping[str, int] = NO_HITS):
    return (-(n.kv_blocks_free + hits.get(n.url, 0) // max(1, n.block_size)), n.running, n.url)


def pick(nodes: list[NodeView], exclude: frozenset[str] | set[str] = frozenset(), hits: Mapping[str, int] = NO_HITS,
         prompt_tokens: int = 0, w: Weights = WEIGHTS) -> Route | None:  # fmt: skip
    """The route for one request, or None when no node can take it. ``hits``: per node, the prompt tokens
    its prefix cache holds (gateway/routing/prefix_index.py); ``prompt_tokens``: the prompt's length."""
    live = [n for n in nodes if n.routable and n.url not in exclude]
    prefill = [n for n in live if n.role == "prefill"]
    decode = [n for n in live if n.role == "decode"]
    if prefill and decode:
        p = min(prefill, key=lambda n: prefill_key(n, prompt_tokens, hits, w)).url
        d = min(decode, key=lambda n: decode_key(n, hits)).url
        if hits.get(d, 0) > 0 and prompt_tokens - hits[d] <= w.local_tokens:
            return Route(both=d, hit_tokens=hits[d])  # the decode node holds all but a few tokens: no pull
        return Route(prefill=p, decode=d, hit_tokens=hits.get(p, 0))
    both = [n for n in live if n.role == "both"]
    if both:
        b = min(both, key=lambda n: prefill_key(n, prompt_tokens, hits, w)).url
        return Route(both=b, hit_tokens=hits.get(b, 0))
    return None
