"""The scaling policy: a pure function of observed load per (model, role) → desired replicas per key.

    decide(ctx, state) -> (Decision, state')

No clock, no I/O, no mutation: the loop (loop.py) observes, calls `decide` with the
time and the previous state, and acts. A key is `(model, role)` ("model/role" in JSON);
every key is sized independently, through the same stages, in order:

 1. core      load / what one replica carries, in replicas (Ray Serve's formula), with the
              per-replica figure *measured* by the nodes where they report one (slo.py:
              decode streams / capacity_streams; prefill queued prompt tokens /
              (prefill_tokens_per_s x slo_ttft_s)); the configured targets only until then;
              and the demand: the gateway's arrival rates / a replica's measured throughput
              (prompt tokens/s for prefill, output tokens/s at the SLO batch for decode).
              The largest wins.
 2. windows   the core load averaged over a stable window (60 s) and a panic window
              (2 s); the panic load is the larger of its window's mean and the demand now
              (already a rate over the gateway's last 1-2 s: not averaged twice, so a burst
              is seen a tick or two after it starts). Panic starts when the panic load is
              >= panic_threshold x ready capacity; in panic replicas only go up (never below the panic
              peak or the current count); panic ends once the stable window has
              caught up with the peak, or a stable window after the last
              over-threshold tick (Knative KPA).
 3. SLO       a TTFT / TPOT / queue-wait p99 over its SLO, while the key has work, raises
              the count to at least current + 1: one step per cooldown-free tick (none
              while a replica is still starting), so the lagging p99 cannot run away. TPOT
              pushes only while the streams exceed what the replicas carry (slo.py). For
              slo_window_s after a key was last at 0 ready replicas with traffic, no p99 is
              read (its samples predate the placement: the wait of the requests the
              activator held, or a previous placement's): they neither push nor veto.
              At zero: a key at 0 replicas with no demand (nothing held, queued, running or
              arriving) stays at 0 — whatever its windows or p99s remember — so a model the
              pool evicted to make room is not placed again by its own history.
 4. bounds    min/max per role. Scale to zero (per model, both roles at once): a model
              idle for scale_to_zero_after_s with no load goes to 0 replicas whatever
              the min, and stays there until a request is held or queued for it; then
              "activation" wakes it to >= 1 replica of each role in that tick (the
              gateway's activator holds the request meanwhile).
 5. stabilise scale-down waits for a cooldown since the last change, is held while any
              SLO signal (or the legacy target_queue_wait_p99_s) is breached — lagging
              signals veto cuts rather than size — and removes at most
              max_scale_down_fraction of the replicas (and max_scale_down_step) per
              decision. A key with a replica still loading is not cut at all (only scale
              to zero and the max bound cut it): its load would be cancelled and started
              again. Scale-up is never delayed; scale to zero skips this stage.
 6. capacity  the actuator's bounds (capacity.py: the machine's cores and memory locally, what can be
              scheduled on Kubernetes): the scale-ups of every key a bound covers add at most its room
              (limit - serving nodes) this tick, the keys with the most load per replica first; a key
              held back says so ("bounds: machine: 2 cores, 1 thread per node → at most 2 serving
              nodes (load wants 5: …)"). Activation from zero is never held back (a held request
              needs one replica; the pool places it on a runtime with room or evicts an idle model).

Each stage is a small function; the one that decided the number writes the reason
`pdserve status` prints ("panic: 6s load 3.1x capacity", "cooldown: 12s left").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from .capacity import CapacityBound
from .config import SIZED, AutoscalerConfig
from .load import Key, RoleLoad, key_str, split_key
from .slo import Breach, breaches, busy, core_load

__all__ = ["AutoscalerConfig", "Decision", "Key", "PolicyContext", "PolicyState", "RoleDecision", "RoleLoad",
           "RoleState", "decide", "key_str", "split_key"]  # fmt: skip

_EPS = 1e-9  # 2.0000000001 replicas of load is 2 replicas, not 3

@dataclass(slots=True, frozen=True)
class RoleState:
    """What one key's policy remembers between ticks."""

    samples: tuple[tuple[float, float], ...] = ()  # (t, core load in replicas), newest last, <= stable window
    panic_over_t: float | None = None  # last tick the panic window was over threshold; None = not in panic
    panic_peak: int = 0  # replicas held during this panic (only grows)
    last_change_t: float | None = None  # when the policy last asked for a different replica count
    activated_t: float | None = None  # when this key was last woken from zero
    zero_t: float | None = None  # the last tick it had 0 ready replicas while its model had traffic (p99s stale)


@dataclass(slots=True, frozen=True)
class PolicyState:
    roles: Mapping[Key, RoleState] = field(default_factory=dict)  # per key; a key first seen starts fresh


@dataclass(slots=True, frozen=True)
class PolicyContext:
    config: AutoscalerConfig
    loads: Mapping[Key, RoleLoad]  # per (model, role); a key left out is not decided this tick
    now: float  # decision time on the loop's clock
    capacity: tuple[CapacityBound, ...] = ()  # the actuator's bounds on serving nodes this tick (stage 6)


@dataclass(slots=True, frozen=True)
class RoleDecision:
    role: str
    replicas: int  # desired replicas
    current: int  # replicas when decided
    reason: str  # why, in words, from the stage that set `replicas`
    panic: bool = False  # in panic mode (only scaling up)
    activation: bool = False  # woken from zero by a held or queued request
    stable_load: float = 0.0  # stable-window load, in replicas
    panic_load: float = 0.0  # panic-window load, in replicas
    model: str = ""
    slo: str = ""  # the SLO breaches seen this tick, "" if none


@dataclass(slots=True, frozen=True)
class Decision:
    t: float
    roles: Mapping[Key, RoleDecision]

    @property
    def replicas(self) -> dict[Key, int]:
        return {k: d.replicas for k, d in self.roles.items()}

    @property
    def reason(self) -> str:
        return "; ".join(f"{key_str(k)}: {d.reason}" for k, d in self.roles.items())

    def to_dict(self) -> dict:
        """JSON-ready, for `pdserve status --json` and the gateway's status endpoint."""
        return {"t": self.t, "roles": {key_str(k): asdict(d) for k, d in self.roles.items()}}


# --- stage 2: stable and panic windows ------------------------------------------------


def window_mean(samples: tuple[tuple[float, float], ...], now: float, window_s: float) -> float:
    vals = [v for t, v in samples if t > now - window_s]
    return sum(vals) / len(vals) if vals else 0.0


def replicas_for(load: float) -> int:
    return max(0, math.ceil(load - _EPS))


def windows(rs: RoleState, load: RoleLoad, stable: float, panic: float, now: float, cfg: AutoscalerConfig,
            signal: str) -> tuple[int, RoleState, str, str]:  # fmt: skip
    """Stable-window sizing, or panic sizing (only up) while a burst lasts; -> (desired, state, reason, event).

    `panic`: the panic load (its window's mean, or the demand now if larger)."""
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
        return desired, rs, f"panic: {cfg.panic_window_s:g}s load {ratio:.1f}x capacity ({signal})", ""
    return stable_n, rs, _stable_reason(stable, signal, cfg), ""


def _stable_reason(stable: float, signal: str, cfg: AutoscalerConfig) -> str:
    return f"stable: {cfg.stable_window_s:g}s load {stable:.1f} replicas ({signal})"


# --- stage 3: SLO signals push up ------------------------------------------------------------


def slo_push(desired: int, load: RoleLoad, rs: RoleState, now: float, cfg: AutoscalerConfig,
             found: list[Breach]) -> tuple[int, str | None]:  # fmt: skip
    """A p99 over its SLO while the key has work: current + 1, once per cooldown, none while one is starting."""
    pushing = [b for b in found if b.pushes]
    if not pushing or desired > load.replicas or not busy(load):
        return desired, None  # nothing breached, the load already asks for more, or nothing to serve faster
    what = ", ".join(map(str, pushing))
    if load.starting:
        return desired, f"SLO: {what}: waiting for {load.starting} starting"
    if rs.last_change_t is not None and now - rs.last_change_t < cfg.scale_down_delay_s:
        left = cfg.scale_down_delay_s - (now - rs.last_change_t)
        return desired, f"SLO: {what}: next step in {left:.0f}s"
    return load.replicas + 1, f"SLO: {what}: {load.replicas} -> {load.replicas + 1}"


def at_zero(load: RoleLoad) -> str | None:
    """Why a key at 0 replicas stays there (no demand of any kind), or None."""
    if load.replicas or load.held or busy(load) or load.requests_per_s > 0:
        return None
    return "at zero: no demand (nothing held, queued, running or arriving)"


# --- stage 4: bounds, scale to zero and activation ----------------------------------------------


def bounds(role: str, desired: int, load: RoleLoad, cfg: AutoscalerConfig, wake: bool,
           zero: str | None, why: str = "") -> tuple[int, bool, str | None]:  # fmt: skip
    """Clamp to [min, max]; a model scaled to zero (`zero`: why) stays at 0; a woken key gets >= 1.
    `why`: the reason the load wants `desired` (kept in a max bound's reason: it says what the burst is)."""
    lo, hi = cfg.bounds(role)
    if zero:
        return 0, False, zero
    if wake and load.replicas == 0:
        waiting = load.held or load.queue_depth
        why = (f"{load.held} held" if load.held else f"{waiting} queued") if waiting else "other role woke"
        return min(max(desired, 1, lo), hi), True, f"activation: {why}, 0 replicas"
    if desired > hi:
        return hi, False, f"bounds: max {hi} (load wants {desired}{': ' + why if why else ''})"
    if desired < lo:
        return lo, False, f"bounds: min {lo} (load wants {desired})"
    return desired, False, None


def to_zero(keys: list[Key], loads: Mapping[Key, RoleLoad], cfg: AutoscalerConfig) -> str | None:
    """Why a model (all its keys) goes to / stays at 0 replicas, or None. Only with scale_to_zero_after_s > 0."""
    after = cfg.scale_to_zero_after_s
    mine = [loads[k] for k in keys]
    if not after or any(x.held or busy(x) for x in mine):
        return None
    if all(x.replicas == 0 for x in mine):
        return "at zero: nothing held or queued"
    idle = min(x.idle_s for x in mine)
    return f"scale to zero: idle {idle:.0f}s >= {after:g}s" if idle >= after else None


def woken(keys: list[Key], loads: Mapping[Key, RoleLoad], cfg: AutoscalerConfig) -> set[Key]:
    """Keys at 0 replicas to wake now: a request is held or queued for them (or for the model's other role)."""
    at_zero = [k for k in keys if loads[k].replicas == 0]
    wake = {k for k in at_zero if loads[k].held or loads[k].queue_depth}
    if wake and cfg.coactivate_roles:  # a request needs both roles: waking one wakes the other
        wake.update(at_zero)
    return wake


# --- stage 5: scale-down stabilisation ------------------------------------------------------


def stabilise(desired: int, load: RoleLoad, rs: RoleState, now: float, cfg: AutoscalerConfig,
              found: list[Breach]) -> tuple[int, str | None]:  # fmt: skip
    """Hold scale-down during the cooldown or while an SLO is breached; then cut at most a fraction / step."""
    current = load.replicas
    if desired >= current:
        return desired, None
    if load.starting:
        return current, f"loading: {load.starting} of {current} not ready yet: holding {current} (load wants {desired})"
    if found:
        return current, f"SLO: {', '.join(map(str, found))}: holding {current} (load wants {desired})"
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
    """One tick: desired replicas for every (model, role) in ctx.loads, and the state for the next tick."""
    cfg, now, loads = ctx.config, ctx.now, ctx.loads
    models: dict[str, list[Key]] = {}
    for key in sorted(loads, key=lambda k: _order(*split_key(k))):
        models.setdefault(split_key(key)[0], []).append(key)
    decisions, states = {}, dict(state.roles)
    for keys in models.values():
        zero, wake = to_zero(keys, loads, cfg), woken(keys, loads, cfg)
        for key in keys:
            decisions[key], states[key] = _decide_key(key, loads[key], state.roles.get(key), cfg, now,
                                                      key in wake, zero)  # fmt: skip
    for bound in ctx.capacity:
        held_back(bound, decisions, states, state.roles, loads)
    return Decision(t=now, roles=decisions), PolicyState(roles=states)


# --- stage 6: capacity -------------------------------------------------------------------------


def held_back(bound: CapacityBound, decisions: dict, states: dict, before: Mapping[Key, RoleState],
              loads: Mapping[Key, RoleLoad]) -> None:  # fmt: skip
    """Cut the scale-ups of the keys `bound` covers to its room, the most loaded first (in place)."""
    ups = [k for k, d in decisions.items() if bound.covers(d.role) and d.replicas > d.current]
    woken = sum(decisions[k].replicas - decisions[k].current for k in ups if decisions[k].activation)
    ups = sorted((k for k in ups if not decisions[k].activation),  # activations first: never held back
                 key=lambda k: (-decisions[k].panic_load / max(loads[k].ready, 1), _order(*split_key(k))))
    room = max(0, bound.room - woken)
    for key in ups:
        d = decisions[key]
        add = min(d.replicas - d.current, room)
        room -= add
        if add == d.replicas - d.current:
            continue
        n = d.current + add
        decisions[key] = replace(d, replicas=n, reason=f"bounds: {bound.why} (load wants {d.replicas}: {d.reason})")
        rs = states[key]
        last = rs.last_change_t if n != d.current else (before.get(key) or rs).last_change_t
        states[key] = replace(rs, panic_peak=min(rs.panic_peak, max(n, d.current)), last_change_t=last)


def _order(model: str, role: str) -> tuple:
    return model, SIZED.index(role) if role in SIZED else len(SIZED), role


def _decide_key(key: Key, load: RoleLoad, rs: RoleState | None, cfg: AutoscalerConfig, now: float, wake: bool,
                zero: str | None) -> tuple[RoleDecision, RoleState]:  # fmt: skip
    model, role = split_key(key)
    rs = rs or RoleState(last_change_t=now)  # a fresh key waits a cooldown before cutting
    core, signal, demand = core_load(role, load, cfg)
    samples = tuple((t, v) for t, v in rs.samples if t > now - cfg.stable_window_s) + ((now, core),)
    rs = replace(rs, samples=samples)
    stable = window_mean(samples, now, cfg.stable_window_s)
    panic = max(window_mean(samples, now, cfg.panic_window_s), demand)
    if load.ready == 0 and (load.held or load.queue_depth or load.ttft_p99_s or load.queue_wait_p99_s
                            or load.tpot_p99_s):  # fmt: skip
        rs = replace(rs, zero_t=now)  # any p99 sample now is from before this key's next placement
    found = breaches(role, load, cfg)
    if rs.zero_t is not None and now - rs.zero_t < cfg.slo_window_s:
        # the p99s still hold the wait of the requests held while it was placed (the activator's, not
        # a sign that the replicas placed are too few) or samples of a previous placement
        found = []

    desired, rs, reason, event = windows(rs, load, stable, panic, now, cfg, signal)
    desired, why = slo_push(desired, load, rs, now, cfg, found)
    reason = why or reason
    still = None if wake else at_zero(load)
    if still:
        desired, reason, event = 0, still, ""
        rs = replace(rs, panic_over_t=None, panic_peak=0)
    desired, activated, why = bounds(role, desired, load, cfg, wake, zero, reason)
    reason = why or reason
    if activated:
        rs = replace(rs, activated_t=now)
    if zero:
        rs = replace(rs, panic_over_t=None, panic_peak=0)
    else:
        desired, why = stabilise(desired, load, rs, now, cfg, found)
        reason = why or reason
        desired = min(desired, cfg.bounds(role)[1])  # bounds are hard: a lowered max wins over the cooldown
    reason = f"{event}; {reason}" if event else reason

    if desired != load.replicas:
        rs = replace(rs, last_change_t=now)
    decision = RoleDecision(role=role, model=model, replicas=desired, current=load.replicas, reason=reason,
                            panic=rs.panic_over_t is not None, activation=activated, stable_load=round(stable, 3),
                            panic_load=round(panic, 3), slo="; ".join(map(str, found)))  # fmt: skip
    return decision, rs
