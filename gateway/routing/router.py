"""Routing policy: a small pure function from node load (and each node's cached prefix) to a
(prefill, decode) pair or a `both` node.

A prompt-taking node (prefill, or `both`) is scored by what stands before the request's first token
there, in prefill tokens (``Weights``; how they were chosen: docs/gateway.md, "Routing by cache"):

    cost = queued_prompt_tokens                  the node's queue, computed first
         + (prompt_tokens - hit)                 this prompt, less what its prefix cache holds
         + running * w.running                   decode tokens the running streams add to those steps
         + (w.kv_short if the node lacks free KV blocks for what it must compute)
         + (its adapter fetch, at its prefill rate, if the request's LoRA adapter is not kept there)

and the lowest cost wins; ties go to the node with the most free KV blocks, then the fewest running
streams. With no hit anywhere this is least load, and an empty node (one that just joined) is the
cheapest. With peer pull on (``PullCost``), a node may instead pull the prompt's longest cached prefix from
the live node holding it (compute/node/peer.py) when that beats computing it: its cost then counts the
holder's hit, plus the pull's time in prefill tokens, so a busy holder's repeats go to an idle node that
pulls, and a node that just joined starts warm. A decode node is picked by its free KV blocks counting its hit as free (blocks it would not
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
    kv_block_bytes: int = 0  # bytes of one KV block, all layers (its /load: kv_bytes / kv_blocks_total; 0: unknown)
    prefill_tokens_per_s: float = 0.0  # its measured prefill rate (/load's capacity report; 0: not measured yet)
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it keeps (NAME@vN: /load's lora.kept)
    adapter_load_s: float = 0.0  # its last adapter fetch, store -> fused (/load's lora; 0: none measured yet)

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining


@dataclass(slots=True, frozen=True)
class Weights:
    """What one unit of each load term costs, in prefill tokens (docs/gateway.md says how they were chosen)."""

    running: float = 2.0  # one running stream: its decode tokens in the steps of this prefill (measured 1.7)
    kv_short: float = 4096.0  # the node lacks free KV blocks for what it must compute: it would wait or preempt
    local_tokens: int = 4  # a decode node whose hit leaves at most this many prompt tokens computes them itself
    adapter_load_s: float = 0.05  # a node's adapter fetch until it measured one (bench lora: +47 ms cold here)
    # (measured: a pull's fixed cost ~5-9 ms vs ~2 ms per recomputed token; 0 turns it off)

    def __post_init__(self) -> None:
        if self.running < 0 or self.kv_short < 0 or self.local_tokens < 0:
            raise ValueError("routing weights must be >= 0")


WEIGHTS = Weights()


@dataclass(slots=True, frozen=True)
class PullCost:
    """A peer pull against computing the same prompt tokens (compute/node/peer.py; the defaults are measured:
    docs/gateway.md, "Peer pull"). Pulling b blocks takes ``fixed_s + b * block_bytes / bytes_per_s``;
    computing them ``b * block_size / prefill_tokens_per_s``: a node pulls when the first is smaller."""

    fixed_s: float = 0.045  # export round trip + transfer setup and confirmation, whatever the size (44 ms here)
    bytes_per_s: float = 0.37e9  # the KV link's rate (TCP between two node processes here: 0.37 GB/s)
    prefill_tokens_per_s: float = 200.0  # a node's prefill rate until its own is measured (/load capacity; 202 here)

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("pull cost: need fixed_s >= 0, bytes_per_s > 0, prefill_tokens_per_s > 0")

    def seconds(self, blocks: int, block_bytes: int) -> float:
        return self.fixed_s + blocks * block_bytes / self.bytes_per_s

    def worth(self, blocks: int, block_size: int, block_bytes: int, prefill_tokens_per_s: float = 0.0) -> bool:
        """Whether pulling ``blocks`` blocks beats computing their tokens (at the node's own measured prefill rate
        when known, else ``prefill_tokens_per_s``)."""
        rate = prefill_tokens_per_s or self.prefill_tokens_per_s
        return blocks > 0 and self.seconds(blocks, block_bytes) < blocks * block_size / rate


PULL = PullCost()


@dataclass(slots=True, frozen=True)
class Route:
    prefill: str | None = None
    decode: str | None = None
    both: str | None = None
    hit_tokens: int = 0  # prompt tokens the prompt-taking node's cache is expected to give
    pull_from: str | None = None  # a node whose cache holds more of the prompt: the prompt-taking node pulls it
    pull_tokens: int = 0  # the prompt tokens that node holds

    @property
    def split(self) -> bool:
        return self.both is None

    def nodes(self) -> tuple[str, ...]:
        return (self.both,) if self.both else (self.prefill, self.decode)


def prefill_cost(n: NodeView, prompt_tokens: int = 0, hit: int = 0, w: Weights = WEIGHTS,
                 adapter: str | None = None) -> float:  # fmt: skip
    """Prefill tokens before this request's first token on ``n`` (the module's formula), plus, for a request of a
    LoRA adapter ``n`` does not keep, its fetch (``cold_tokens``)."""
    todo = max(0, prompt_tokens - hit)
    short = w.kv_short if n.kv_blocks_free * n.block_size < todo else 0.0
    return n.queued_prompt_tokens + todo + n.running * w.running + short + cold_tokens(n, adapter, w)


def cold_tokens(n: NodeView, adapter: str | None, w: Weights = WEIGHTS) -> float:
    """What fetching ``adapter`` (NAME@vN) costs ``n``, in its prefill tokens: its measured (else the default)
    fetch time at its prefill rate; 0 where it keeps it or for the base."""
    if adapter is None or adapter in n.adapters:
        return 0.0
    return (n.adapter_load_s or w.adapter_load_s) * (n.prefill_tokens_per_s or PULL.prefill_tokens_per_s)


def prefill_key(n: NodeView, prompt_tokens: int = 0, hits: Mapping[str, int] = NO_HITS, w: Weights = WEIGHTS,
                holders: list[NodeView] = (), pull: PullCost | None = None, adapter: str | None = None):  # fmt: skip
    return (_pulled(n, prompt_tokens, hits, w, holders, pull, adapter)[0], -n.kv_blocks_free, n.running, n.url)


def _pulled(n: NodeView, prompt_tokens: int, hits: Mapping[str, int], w: Weights, holders: list[NodeView],
            pull: PullCost | None, adapter: str | None = None) -> tuple[float, str | None, int]:  # fmt: skip
    """``n``'s cost, computing what its cache lacks or pulling it from the holder of the longest prefix when that
    is cheaper (the pull's time counted as the prefill tokens it is worth): (cost, holder or None, its hit)."""
    own = hits.get(n.url, 0)
    best = (prefill_cost(n, prompt_tokens, own, w, adapter), None, 0)
    if pull is None:
        return best
    h = max((v for v in holders if v.url != n.url), key=lambda v: (hits.get(v.url, 0), v.url), default=None)
    theirs = hits.get(h.url, 0) if h is not None else 0
    blocks = (theirs - own) // max(1, n.block_size)
    size = (n.kv_block_bytes or h.kv_block_bytes) if h is not None else 0
    rate = n.prefill_tokens_per_s or pull.prefill_tokens_per_s
    if h is None or not pull.worth(blocks, n.block_size, size, rate):
        return best
    cost = prefill_cost(n, prompt_tokens, theirs, w, adapter) + pull.seconds(blocks, size) * rate
    return (cost, h.url, theirs) if cost < best[0] else best


def decode_key(n: NodeView, hits: Mapping[str, int] = NO_HITS, adapter: str | None = None, w: Weights = WEIGHTS):
    """Free KV blocks counting its hit as free, less an adapter fetch's worth of blocks where it lacks the adapter."""
    cold = cold_tokens(n, adapter, w) // max(1, n.block_size)
    return (-(n.kv_blocks_free + hits.get(n.url, 0) // max(1, n.block_size) - cold), n.running, n.url)


def pick(nodes: list[NodeView], exclude: frozenset[str] | set[str] = frozenset(), hits: Mapping[str, int] = NO_HITS,
         prompt_tokens: int = 0, w: Weights = WEIGHTS, pull: PullCost | None = None,
         adapter: str | None = None) -> Route | None:  # fmt: skip
    """The route for one request, or None when no node can take it. ``hits``: per node, the prompt tokens
    its prefix cache holds (gateway/routing/prefix_index.py); ``prompt_tokens``: the prompt's length. ``pull``:
    a prompt-taking node may pull the longest cached prefix from the live node holding it (``PullCost``).
    ``adapter``: the request's LoRA adapter (NAME@vN): a node that must fetch it pays its fetch (``cold_tokens``)."""
    live = [n for n in nodes if n.routable and n.url not in exclude]
    holders = [n for n in live if hits.get(n.url, 0) > 0] if pull is not None else []
    prefill = [n for n in live if n.role == "prefill"]
    decode = [n for n in live if n.role == "decode"]
    if prefill and decode:
        p = min(prefill, key=lambda n: prefill_key(n, prompt_tokens, hits, w, holders, pull, adapter))
        d = min(decode, key=lambda n: decode_key(n, hits, adapter, w)).url
        if hits.get(d, 0) > 0 and prompt_tokens - hits[d] <= w.local_tokens:
            return Route(both=d, hit_tokens=hits[d])  # the decode node holds all but a few tokens: no pull
        _, src, theirs = _pulled(p, prompt_tokens, hits, w, holders, pull, adapter)
        return Route(prefill=p.url, decode=d, hit_tokens=hits.get(p.url, 0), pull_from=src, pull_tokens=theirs)
    both = [n for n in live if n.role == "both"]
    if both:
        b = min(both, key=lambda n: prefill_key(n, prompt_tokens, hits, w, holders, pull, adapter))
        _, src, theirs = _pulled(b, prompt_tokens, hits, w, holders, pull, adapter)
        return Route(both=b.url, hit_tokens=hits.get(b.url, 0), pull_from=src, pull_tokens=theirs)
    return None
