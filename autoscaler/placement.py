"""Placement: the warm pool's records and its pure ranking (autoscaler/pool.py's RuntimePool acts on them).

Holds no thread, no lock and no HTTP client: plain data in, plain data out.
  PoolConfig   how many standby runtimes per role, how many runtimes at least and at most, and the bounds
               on node calls; ``pool_config()`` derives it from an AutoscalerConfig (and ``pdserve up``'s plan);
  Runtime      one runtime as its last ``GET /load`` showed it (state, models held, memory, ``cached``);
  rank         the runtimes a claim of (model, role) may go to, best first, each with why.

Placement ranking (``rank``), best first, among runtimes of the role that are up, not draining and not
holding m: the highest ``cached[m]`` (ServerlessLLM: load from what is local), then standby (no model),
then one with memory room for m, then one with an idle model to evict that no key wants (desired 0),
then one whose idle models are still wanted (least recently used, the node's choice, never one in
``keep``). A runtime with none of these would only answer 503: it is not a candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from compute.node.protocol import ModelLoad

Key = tuple[str, str]  # (model, role)
HOLDING = ("loading", "ready")  # model states that make a runtime a replica of (model, role)


@dataclass(slots=True)
class PoolConfig:
    """How many standby runtimes to keep, how many runtimes at most, and the bounds on node calls."""

    pool_size: int = 1  # standby runtimes kept per role (AutoscalerConfig.pool_size)
    max_runtimes: Mapping[str, int] = field(default_factory=dict)  # role -> runtimes at most; absent: 8
    min_runtimes: Mapping[str, int] = field(default_factory=dict)  # role -> runtimes kept up at least; absent: 0
    protect_s: float = 5.0  # a wanted model ready this recently, unserved since, is not evicted by a claim
    unload_timeout_s: float = 30.0  # a model's drain on unload is bounded by this
    http_timeout_s: float = 2.0  # each /load read and load call
    history: int = 20  # claims kept for status()

    def __post_init__(self) -> None:
        if not isinstance(self.pool_size, int) or self.pool_size < 0:
            raise ValueError(f"pool_size={self.pool_size} must be an int >= 0")
        for role, n in self.max_runtimes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"max_runtimes[{role!r}]={n} must be an int >= 1")
        for role, n in self.min_runtimes.items():
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"min_runtimes[{role!r}]={n} must be an int >= 0")
        if self.unload_timeout_s <= 0 or self.http_timeout_s <= 0 or self.history < 1 or self.protect_s < 0:
            raise ValueError("unload_timeout_s > 0, http_timeout_s > 0, history >= 1, protect_s >= 0")

    def cap(self, role: str) -> int:
        return max(self.max_runtimes.get(role, 8), self.floor(role))

    def floor(self, role: str) -> int:
        return self.min_runtimes.get(role, 0)


@dataclass(slots=True)
class Runtime:
    """One runtime as its last ``/load`` showed it."""

    role: str
    url: str
    name: str = ""
    up: bool = False  # its actuator saw /ready (a standby runtime is ready at once)
    reachable: bool = False  # /load answered this tick
    state: str = "starting"  # starting | standby | loading | ready | draining | unreachable | unproven
    models: dict[str, ModelLoad] = field(default_factory=dict)  # name -> its /load.models entry
    budget: int = 0  # memory_budget_bytes
    used: int = 0  # memory_used_bytes
    cached: dict[str, float] = field(default_factory=dict)

    def holds(self, model: str) -> bool:
        m = self.models.get(model)
        return m is not None and m.state in HOLDING

    @property
    def busy(self) -> bool:
        """Holds a model (loading, ready or draining; an unreachable runtime: as last seen)."""
        return any(m.state in (*HOLDING, "draining") for m in self.models.values())

    @property
    def standby(self) -> bool:
        return self.reachable and not self.busy

    def idle_models(self) -> list[str]:
        """Ready models with no active request (the node's eviction candidates)."""
        return [n for n, m in self.models.items() if m.state == "ready" and not m.active_requests]


def rank(runtimes: list[Runtime], model: str, role: str, need_bytes: int = 0,
         wanted: frozenset | set = frozenset(), keep: Mapping[str, set] | None = None) -> list[tuple[Runtime, str]]:  # fmt: skip
    """The runtimes a claim of (model, role) may go to, best first, each with why (see the module doc).
    ``wanted``: models some key of the role wants (> 0 replicas); ``keep[url]``: models not to evict there."""
    out = []
    for rt in runtimes:
        if rt.role != role or not (rt.up and rt.reachable) or rt.state == "draining" or model in rt.models:
            continue  # a model held in any state (failed too: unload it first) is not claimed there again
        free = rt.budget - rt.used
        room = free > 0 and free >= need_bytes
        idle = [m for m in rt.idle_models() if m not in (keep or {}).get(rt.url, ())]
        if not (rt.standby or room or idle):
            continue
        hurts = sum(1 for m in idle if m in wanted)  # evicting one of these takes a replica the policy wants
        cached = float(rt.cached.get(model, 0.0))
        if cached > 0:
            why = f"node cache holds {cached:.0%} of {model}'s shards"
        elif rt.standby:
            why = "standby runtime"
        elif room:
            why = f"memory room ({free / 2**30:.2f} GiB free)"
        else:
            why = f"evicts an idle model ({', '.join(sorted(idle))})" + (" still wanted" if hurts == len(idle) else "")
        out.append(((not room and not rt.standby and hurts == len(idle), -cached, not rt.standby, not room,
                     hurts, -len(idle), rt.url), rt, why))  # fmt: skip
    return [(rt, why) for _, rt, why in sorted(out, key=lambda t: t[0])]


def pool_config(config, roles: tuple[str, ...], floors: Mapping[str, int] | None = None) -> PoolConfig:
    """The pool's settings from an AutoscalerConfig: its pool_size (1 where it has none) standby runtimes per
    role within at most {role}_max_replicas runtimes (on top of them where min = max: a fixed count), and at least ``floors[role]`` (``pdserve up``: the plan's
    counts) or {role}_min_replicas runtimes kept up (standby when nothing is held)."""
    size = int(getattr(config, "pool_size", 1))
    caps, lows = {}, {}
    for role in roles:
        lo, hi = config.bounds(role)
        lows[role] = max(int(lo), int((floors or {}).get(role, 0)))
        caps[role] = max(int(hi), lows[role], 1)
        if int(lo) == int(hi) and (floors or {}).get(role, hi) == hi:  # a fixed count (`pdserve up` without
            caps[role] += size  # --autoscale): its standby runtimes on top, so a dead replica is replaced by a claim
    return PoolConfig(pool_size=size, max_runtimes=caps, min_runtimes=lows)
