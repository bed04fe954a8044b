"""The scaling policy: a pure function of observed load per role → desired replicas per role.

    decide(ctx, state) -> (Decision, state')

No clock, no I/O, no mutation: the loop (loop.py) observes, calls `decide` with the
time and the previous state, and acts. Prefill and decode are sized independently,
each through the same stages, in order:

 1. core      load / per-replica target, in replicas (Ray Serve's formula); the
              largest signal of the role wins (prefill: queued + in-flight prompt
              tokens; decode: running + queued streams, and KV blocks in use, i.e.
              mean utilisation x ready replicas). All are absolute amounts of work,
              so the result does not compound as replicas are added.
 2. windows   the core load averaged over a stable window (60 s) and a panic window
              (6 s). Panic starts when the panic-window load is >= panic_threshold x
              ready capacity; in panic replicas only go up (never below the panic
              peak or the current count); panic ends once the stable window has
              caught up with the peak, or a stable window after the last
              over-threshold tick (Knative KPA).
 3. bounds    min/max per role; with min 0 a role may scale to zero, and is woken
              ("activation") to 1 replica as soon as a request queues for it — the
              gateway holds that request while the node starts.
 4. stabilise scale-down waits for a cooldown since the last change, is held while the
              role's p99 queue wait is over its target (a lagging signal: it vetoes
              cuts rather than sizing), and removes at most max_scale_down_fraction
              of the replicas (and max_scale_down_step) per decision. Scale-up is
              never delayed.

Each stage is a small function; the one that decided the number writes the reason
`pdserve status` prints ("panic: 6s load 3.1x capacity", "cooldown: 12s left").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from .config import ROLES, AutoscalerConfig

__all__ = ["AutoscalerConfig", "Decision", "PolicyContext", "PolicyState", "RoleDecision", "RoleLoad", "RoleState",
           "decide"]  # fmt: skip

_EPS = 1e-9  # 2.0000000001 replicas of load is 2 replicas, not 3


@dataclass(slots=True)
class RoleLoad:
    """What the gateway and the nodes of one role report, at time `t`."""

    replicas: int = 0  # replicas the actuator runs now (its spec: ready + starting)
    ready: int = 0  # replicas serving (readiness: weights loaded)
    starting: int = 0  # replicas started, not ready yet
    queue_depth: int = 0  # requests waiting for this role at the gateway
    queue_wait_p50_s: float = 0.0  # queue waiting time, median (s)
    queue_wait_p99_s: float = 0.0  # queue waiting time, p99 (s)
    queued_prompt_tokens: int = 0  # prefill: prompt tokens waiting or being prefilled
    running_streams: int = 0  # decode: streams being decoded
    kv_utilisation: float = 0.0  # decode: KV blocks used / total, mean over ready replicas, 0..1
    t: float = 0.0  # when this was observed (the loop's clock)


@dataclass(slots=True, frozen=True)
class RoleState:
    """What one role's policy remembers between ticks."""

    samples: tuple[tuple[float, float], ...] = ()  # (t, core load in replicas), newest last, <= stable window
    panic_over_t: float | None = None  # last tick the panic window was over threshold; None = not in panic
    panic_peak: int = 0  # replicas held during this panic (only grows)
    last_change_t: float | None = None  # when the policy last asked for a different replica count


@dataclass(slots=True, frozen=True)
class PolicyState:
    roles: Mapping[str, RoleState] = field(default_factory=dict)  # per role; a role first seen starts fresh


@dataclass(slots=True, frozen=True)
class PolicyContext:
    config: AutoscalerConfig
    loads: Mapping[str, RoleLoad]  # per role; a role left out is not decided this tick
    now: float  # decision time on the loop's clock


@dataclass(slots=True, frozen=True)
class RoleDecision:
    role: str
    replicas: int  # desired replicas
    current: int  # replicas when decided
    reason: str  # why, in words, from the stage that set `replicas`
    panic: bool = False  # in panic mode (only scaling up)
    activation: bool = False  # woken from zero by a queued request
    stable_load: float = 0.0  # stable-window load, in replicas
    panic_load: float = 0.0  # panic-window load, in replicas


@dataclass(slots=True, frozen=True)
class Decision:
    t: float
    roles: Mapping[str, RoleDecision]

    @property
    def replicas(self) -> dict[str, int]:
        return {r: d.replicas for r, d in self.roles.items()}

    @property
    def reason(self) -> str:
        return "; ".join(f"{r}: {d.reason}" for r, d in self.roles.items())

    def to_dict(self) -> dict:
        """JSON-ready, for `pdserve status --json` and the gateway's status endpoint."""
        return {"t": self.t, "roles": {r: asdict(d) for r, d in self.roles.items()}}


# --- stage 1: core formula ----------------------------------------------------------


def core_load(role: str, load: RoleLoad, cfg: AutoscalerConfig) -> tuple[float, str]:
    """Replicas the observed load needs now, and the signal that said so (the largest)."""
    signals: dict[str, float] = {}
    if role == "prefill":
        signals["queued prompt tokens"] = load.queued_prompt_tokens / cfg.target_queued_prompt_tokens_per_replica
    else:
        streams = load.running_streams + load.queue_depth
        signals["streams"] = streams / cfg.target_running_streams_per_replica
        signals["kv blocks"] = load.kv_utilisation / cfg.target_kv_utilisation * load.ready
    name = max(signals, key=signals.__getitem__)
    return signals[name], name


# --- stage 2: stable and panic windows ------------------------------------------------


def window_mean(samples: tuple[tuple[float, float], ...], now: float, window_s: float) -> float:
    vals = [v for t, v in samples if t > now - window_s]
    return sum(vals) / len(vals) if vals else 0.0


def replicas_for(load: float) -> int:
    return max(0, math.ceil(load - _EPS))


def windows(rs: RoleState, load: RoleLoad, stable: float, panic: float, now: float, cfg: AutoscalerConfig,
            signal: str) -> tuple[int, RoleState, str, str]:  # fmt: skip
    """Stable-window sizing, or panic sizing (only up) while a burst lasts; -> (desired, state, reason, event)."""
    ratio = panic / max(load.ready, 1)
    over = ratio >= cfg.panic_threshold
    stable_n, panic_n = replicas_for(stable), replicas_for(panic)
    in_panic = rs.panic_over_t is not None
    if over:
        if not in_panic:
            rs = replace(rs, panic_peak=load.replicas)
        rs = replace(rs, panic_over_t=now)
    elif in_panic:
        caught_up = stable_n >= rs.panic_peak
        calmed = now - rs.panic_over_t >= cfg.stable_window_s
        if caught_up or calmed:
            rs = replace(rs, panic_over_t=None, panic_peak=0)
            why = "stable window caught up" if caught_up else f"calm for {cfg.stable_window_s:g}s"
            return stable_n, rs, _stable_reason(stable, signal, cfg), f"leaving panic ({why})"
    if rs.panic_over_t is not None:
        desired = max(panic_n, stable_n, rs.panic_peak, load.replicas)
        rs = replace(rs, panic_peak=desired)
        return desired, rs, f"panic: {cfg.panic_window_s:g}s load {ratio:.1f}x capacity", ""
    return stable_n, rs, _stable_reason(stable, signal, cfg), ""


def _stable_reason(stable: float, signal: str, cfg: AutoscalerConfig) -> str:
    return f"stable: {cfg.stable_window_s:g}s load {stable:.1f} replicas ({signal})"


# --- stage 3: bounds and activation -------------------------------------------------------


def wants_activation(role: str, load: RoleLoad, cfg: AutoscalerConfig) -> bool:
    """A role at zero replicas with a request queued for it must wake now."""
    return cfg.bounds(role)[0] == 0 and load.replicas == 0 and load.queue_depth > 0


def bounds(role: str, desired: int, load: RoleLoad, cfg: AutoscalerConfig, wake: bool) -> tuple[int, bool, str | None]:
    """Clamp to [min, max]; wake a role at zero when a request waits (activation)."""
    lo, hi = cfg.bounds(role)
    if wake and load.replicas == 0:
        why = f"{load.queue_depth} queued" if load.queue_depth else "other role woke"
        return min(max(desired, 1), hi), True, f"activation: {why}, 0 replicas"
    if desired > hi:
        return hi, False, f"bounds: max {hi} (load wants {desired})"
    if desired < lo:
        return lo, False, f"bounds: min {lo} (load wants {desired})"
    return desired, False, None


# --- stage 4: scale-down stabilisation ------------------------------------------------------


def stabilise(desired: int, load: RoleLoad, rs: RoleState, now: float, cfg: AutoscalerConfig) -> tuple[int, str | None]:
    """Hold scale-down during the cooldown or while requests wait too long; then cut at most a fraction / step."""
    current = load.replicas
    if desired >= current:
        return desired, None
    if cfg.target_queue_wait_p99_s and load.queue_wait_p99_s > cfg.target_queue_wait_p99_s:
        return current, (f"queue wait p99 {load.queue_wait_p99_s:.2f}s > {cfg.target_queue_wait_p99_s:g}s target: "
                         f"holding {current} (load wants {desired})")  # fmt: skip
    if rs.last_change_t is not None and now - rs.last_change_t < cfg.scale_down_delay_s:
        left = cfg.scale_down_delay_s - (now - rs.last_change_t)
        return current, f"cooldown: {left:.0f}s left (load wants {desired}, holding {current})"
    step = max(1, math.floor(current * cfg.max_scale_down_fraction))
    if cfg.max_scale_down_step:
        step = min(step, cfg.max_scale_down_step)
    if current - desired > step:
        return current - step, f"scale-down rate: {current} -> {current - step} (load wants {desired})"
    return desired, None


# --- the policy ---------------------------------------------------------------------------------


def decide(ctx: PolicyContext, state: PolicyState) -> tuple[Decision, PolicyState]:
    """One tick: desired replicas for every role in ctx.loads, and the state for the next tick."""
    cfg, now = ctx.config, ctx.now
    loads = {r: ctx.loads[r] for r in ROLES if r in ctx.loads}
    woken = [r for r, load in loads.items() if wants_activation(r, load, cfg)]
    decisions, states = {}, dict(state.roles)
    for role, load in loads.items():
        rs = state.roles.get(role) or RoleState(last_change_t=now)  # a fresh loop waits a cooldown before cutting
        core, signal = core_load(role, load, cfg)
        samples = tuple((t, v) for t, v in rs.samples if t > now - cfg.stable_window_s) + ((now, core),)
        rs = replace(rs, samples=samples)
        stable = window_mean(samples, now, cfg.stable_window_s)
        panic = window_mean(samples, now, cfg.panic_window_s)

        desired, rs, reason, event = windows(rs, load, stable, panic, now, cfg, signal)
        wake = role in woken or (bool(woken) and cfg.coactivate_roles and cfg.bounds(role)[0] == 0)
        desired, activated, why = bounds(role, desired, load, cfg, wake)
        reason = why or reason
        desired, why = stabilise(desired, load, rs, now, cfg)
        reason = why or reason
        reason = f"{event}; {reason}" if event else reason
        desired = min(desired, cfg.bounds(role)[1])  # bounds are hard: a lowered max wins over the cooldown

        if desired != load.replicas:
            rs = replace(rs, last_change_t=now)
        states[role] = rs
        decisions[role] = RoleDecision(role=role, replicas=desired, current=load.replicas, reason=reason,
                                       panic=rs.panic_over_t is not None, activation=activated,
                                       stable_load=round(stable, 3), panic_load=round(panic, 3))  # fmt: skip
    return Decision(t=now, roles=decisions), PolicyState(roles=states)
