"""What one replica carries, from what the nodes measured, and the SLO signals: stages 1 and 3 of policy.py.

Stage 1, `core_load` — replicas the observed load of one (model, role) needs now:
  decode   streams (running + queued at the nodes + queued at the gateway) / streams one replica
           carries within the TPOT target. That figure is `capacity_streams`: the mean over the
           ready replicas of the batch at which the node's own fitted step time passes its TPOT
           target (compute/node/capacity.py). KV blocks in use / target utilisation is a second
           signal; the larger wins.
  prefill  queued prompt tokens / the tokens one replica prefills within the TTFT SLO, i.e.
           `prefill_tokens_per_s` (measured, mean over the ready replicas) x `slo_ttft_s`, at
           most one replica per prompt there (a prompt is prefilled on one replica).
  both     a colocated node does both: the larger of the two (its own measured rates: a both node
           reports prefill tokens/s and decode streams alike).
  The configured per-replica targets (`target_*_per_replica`) are used only while no node has
  measured anything yet; the reason says which figure was used.
  demand   (config demand_signal; Dynamo's SLA planner) what arrives, against what a replica
           clears: prefill prompt_tokens_per_s / prefill_tokens_per_s; decode output_tokens_per_s
           / decode_tokens_per_s at the SLO batch (both rates the gateway's, over its last 1-2 s).
           The queue and the streams only grow once the replicas are already behind; the rate
           shows a burst as it arrives. Only with a measured capacity: a constant would guess.
           Capped by the requests behind the rate (`recent_requests`): a prompt is prefilled on
           one replica, so prefill needs no more replicas than prompts arrived; decode no more
           than the streams there are plus those arrived, at what a replica carries. One long
           prompt or one max_tokens=2048 request in a quiet second is a rate of noise, not a burst.

Stage 3, `breaches` — the gateway-observed p99s over their SLOs, per role:
  prefill  TTFT and queue wait (a request waits, then is prefilled: both are prefill's to fix)
  decode   TPOT (pushes only while the streams per ready replica exceed what one carries at the
           SLO, `capacity_streams` or the fallback target: below that a long TPOT is the prefill ->
           decode handoff or the CPU's other tenants, and another replica does not shorten it),
           queue wait (only vetoes scale-down: more decoders do not admit faster)
  both     TTFT, TPOT and queue wait, each as above (queue wait pushes: a both node admits)
A breach that pushes raises the desired count to at least current + 1 (see policy.slo_push);
any breach holds scale-down. A p99 is a lagging signal: it sizes nothing on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .config import AutoscalerConfig
    from .load import RoleLoad


class Breach(NamedTuple):
    what: str  # "TTFT" | "TPOT" | "queue wait"
    p99_s: float  # observed
    slo_s: float  # configured
    pushes: bool  # raises the replica count (else it only vetoes scale-down)

    def __str__(self) -> str:
        return f"{self.what} p99 {self.p99_s:.2f}s > {self.slo_s:g}s SLO"


# role -> (label, RoleLoad field, AutoscalerConfig field, pushes up)
_SIGNALS = {
    "prefill": (("TTFT", "ttft_p99_s", "slo_ttft_s", True), ("queue wait", "queue_wait_p99_s", "slo_queue_wait_s", True)),
    "decode": (("TPOT", "tpot_p99_s", "slo_tpot_s", True), ("queue wait", "queue_wait_p99_s", "slo_queue_wait_s", False)),
    "both": (("TTFT", "ttft_p99_s", "slo_ttft_s", True), ("TPOT", "tpot_p99_s", "slo_tpot_s", True),
             ("queue wait", "queue_wait_p99_s", "slo_queue_wait_s", True)),
}  # fmt: skip


def core_load(role: str, load: RoleLoad, cfg: AutoscalerConfig) -> tuple[float, str, float]:
    """Replicas the observed load needs now, the signal that said so (the largest), and the demand signal's
    replicas alone (0.0 when off or not measured: panic reads it as it is, see policy.windows)."""
    if role == "both":  # a colocated node prefills and decodes: whichever needs more replicas
        (n, name, d), (n2, name2, d2) = core_load("prefill", load, cfg), core_load("decode", load, cfg)
        return (n, name, max(d, d2)) if n >= n2 else (n2, name2, max(d, d2))
    signals: dict[str, float] = {}
    demand = demand_load(role, load, cfg)
    if demand is not None:
        signals[demand[1]] = demand[0]
    if role == "prefill":
        tps = load.prefill_tokens_per_s
        if tps and cfg.slo_ttft_s:  # (an SLO of 0 is off: then the configured target sizes it)
            per, name = tps * cfg.slo_ttft_s, f"queued prompt tokens, {tps:.0f} tok/s measured x {cfg.slo_ttft_s:g}s"
        else:
            per, name = cfg.target_queued_prompt_tokens_per_replica, "queued prompt tokens"
        prompts = load.running_streams + load.node_queued + load.queue_depth
        # a prompt is prefilled on one replica: no more replicas than prompts (one long prompt is no burst)
        signals[name] = load.queued_prompt_tokens / per if not prompts else min(load.queued_prompt_tokens / per, prompts)
    else:
        streams = load.running_streams + load.node_queued + load.queue_depth
        if load.capacity_streams:
            per = max(1.0, load.capacity_streams)  # a node that carries less than one stream still carries one
            name = f"streams, {per:.1f} per replica measured"
        else:
            per, name = cfg.target_running_streams_per_replica, "streams"
        signals[name] = streams / per
        signals["kv blocks"] = load.kv_utilisation / cfg.target_kv_utilisation * load.ready
    name = max(signals, key=signals.__getitem__)
    return signals[name], name, demand[0] if demand else 0.0


def demand_load(role: str, load: RoleLoad, cfg: AutoscalerConfig) -> tuple[float, str] | None:
    """(replicas the arrival rate needs, its name), or None: off, or no replica has measured its capacity."""
    if not cfg.demand_signal:
        return None
    if role == "prefill" and load.prefill_tokens_per_s:
        tps = load.prefill_tokens_per_s
        need = min(load.prompt_tokens_per_s / tps, load.recent_requests)
        return need, f"prompt demand {load.prompt_tokens_per_s:.0f} tok/s, {tps:.0f} measured"
    if role == "decode" and load.decode_tokens_per_s:
        tps, per = load.decode_tokens_per_s, max(1.0, load.capacity_streams or cfg.target_running_streams_per_replica)
        streams = load.running_streams + load.node_queued + load.queue_depth + load.recent_requests
        need = min(load.output_tokens_per_s / tps, streams / per)
        return need, f"output demand {load.output_tokens_per_s:.0f} tok/s, {tps:.0f} measured"
    return None


def streams_per_replica(load: RoleLoad) -> float:
    """Decode streams (running + queued at the nodes and the gateway) per ready replica."""
    return (load.running_streams + load.node_queued + load.queue_depth) / max(load.ready, 1)


def over_capacity(load: RoleLoad, cfg: AutoscalerConfig) -> bool:
    """The decode replicas carry more streams than they can at the SLO batch (measured, else the target)."""
    per = max(1.0, load.capacity_streams) if load.capacity_streams else cfg.target_running_streams_per_replica
    return streams_per_replica(load) > per


def breaches(role: str, load: RoleLoad, cfg: AutoscalerConfig) -> list[Breach]:
    """The role's SLO signals over their SLO now (an SLO of 0 is off)."""
    out = []
    for what, field, slo, pushes in _SIGNALS.get(role, ()):
        p99, limit = getattr(load, field), getattr(cfg, slo)
        if limit and p99 > limit:
            if what == "TPOT" and pushes:
                pushes = over_capacity(load, cfg)  # only then can one more replica shorten it
            out.append(Breach(what, p99, limit, pushes))
    return out


def busy(load: RoleLoad) -> bool:
    """Work in flight or waiting for this (model, role): only then can more replicas help a breach."""
    return bool(load.queue_depth or load.running_streams or load.node_queued or load.queued_prompt_tokens)
