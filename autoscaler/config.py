"""AutoscalerConfig: every knob of the scaling policy and its control loop, in one place.

Loaded at the boundary (the CLI reads the `[autoscaler]` table of the ConfigMap's
pdserve.toml and calls `AutoscalerConfig.from_mapping`); nothing below reads the
environment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")  # a split deployment's roles, each sized independently (Kubernetes, `--prefill N`)
SIZED = (*ROLES, "both")  # every role the policy sizes: "both" nodes prefill and decode (`pdserve up`'s default)


@dataclass(slots=True)
class AutoscalerConfig:
    """SLOs, targets, bounds, windows and stabilisation of the per-(model, role) policy (see policy.py)."""

    # --- control loop ---
    tick_s: float = 0.5  # seconds between observe → decide → act ticks. Locally a decision costs ~1 ms and the
    #   gateway's arrival rates move within a second, so 0.5 s puts a burst's decision ~1 s after its onset
    #   (the Kubernetes overlays set their own, slower tick: an API call per change)

    # --- per-replica targets: the core formula is load / target (Ray Serve's shape); the two counts are
    #     fallbacks, used only while no node of the key has measured its capacity (see slo.py) ---
    target_queued_prompt_tokens_per_replica: int = 8192  # prefill: queued prompt tokens one replica should carry
    target_running_streams_per_replica: int = 32  # decode: running + queued streams one replica should carry
    target_kv_utilisation: float = 0.7  # decode: KV block use per replica (0..1); the alert fires at 0.8
    target_queue_wait_p99_s: float = 2.0  # both: while the p99 queue wait is above this, no scale-down; 0 disables
    demand_signal: bool = True  # size also on arrival rates (Dynamo's SLA planner): prefill by the gateway's
    #   prompt_tokens_per_s / a replica's measured prefill_tokens_per_s, decode by output_tokens_per_s / a
    #   replica's decode tokens/s at its SLO batch; the larger of this and the queue / streams signal wins.
    #   Needs measured capacity (no demand signal on the configured fallback targets)

    # --- SLOs: the gateway-observed p99s (last 60 s) the policy sizes for; 0 turns one off ---
    # Defaults fit a 2-core CPU box running SmolLM2-135M, where a decode step at batch 1 takes ~10-20 ms
    # (1 thread) and a 512-token prefill 0.4-1 s.
    slo_ttft_s: float = 2.0  # prefill: p99 time to first token. A 512-token prompt's prefill alone is up to ~1 s
    #   here, so 1 s would be breached by long prompts that more replicas cannot help; 2 s still feels
    #   interactive and leaves one prompt's worth of queue. Also sizes prefill: a replica carries
    #   prefill_tokens_per_s x slo_ttft_s queued prompt tokens.
    slo_tpot_s: float = 0.2  # decode: p99 time per output token as the gateway sees it: (last token - first
    #   token) / (tokens - 1). That includes the prefill -> decode handoff after the first token (KV transfer,
    #   the decode node's admission) and, on 2 shared cores, the other processes' CPU: measured 0.14 s p99 at a
    #   quarter of capacity while the decode step itself took ~0.05 s. The node sizes its batch on its own
    #   step (tpot_target_s 0.1: the capacity report's max_streams); the gateway's SLO is the user's view, 5
    #   tokens/s, about reading speed. It only pushes while the streams exceed what the replicas carry
    #   (slo.py): a p99 over it at low load is the handoff, which more replicas do not shorten.
    slo_queue_wait_s: float = 1.0  # prefill: p99 wait for admission. Half the TTFT budget: a request that waited
    #   longer cannot make its TTFT once a long prompt's prefill (~1 s here) is added.
    scale_to_zero_after_s: float = 300.0  # a model idle this long (no request arrived or finished, no load) goes to
    #   0 replicas of every role, whatever the min; 0 = never. Coming back costs a claim from the warm pool
    #   (weights injected in ~0.5 s here) plus the first prefill, ~1-2 s; 5 minutes (Ollama's keep_alive
    #   default) keeps a model through pauses of a conversation and frees its memory after.
    slo_window_s: float = 60.0  # the window of the gateway's p99s (gateway/admission/traffic.py WINDOW_S): for this long
    #   after a key comes from 0 ready replicas its p99s hold samples from before it was placed (the wait of
    #   requests the activator held), which say nothing of its capacity: they neither push nor veto
    pool_size: int = 1  # standby runtimes kept per role by the warm pool (autoscaler/pool.py); 0 = none

    # --- bounds per role (min 0 = scale to zero allowed, woken by activation) ---
    prefill_min_replicas: int = 1  # never fewer prefill replicas than this
    prefill_max_replicas: int = 8  # never more prefill replicas than this
    decode_min_replicas: int = 1  # never fewer decode replicas than this
    decode_max_replicas: int = 8  # never more decode replicas than this
    both_min_replicas: int = 1  # colocated nodes (prefill and decode in one): never fewer than this
    both_max_replicas: int = 8  # never more colocated nodes than this

    # --- windows (Knative KPA) ---
    stable_window_s: float = 60.0  # load is averaged over this window for normal decisions
    panic_window_s: float = 2.0  # short window that detects bursts (4 ticks); must be < stable_window_s. The
    #   demand signal is a rate over the gateway's own 1-2 s window: panic reads it as it is, not averaged again
    panic_threshold: float = 2.0  # enter panic when panic-window load >= this x ready capacity

    # --- scale-down stabilisation ---
    scale_down_delay_s: float = 30.0  # cooldown: no scale-down until this long after the last change
    max_scale_down_fraction: float = 0.5  # at most this fraction of current replicas removed per decision
    max_scale_down_step: int = 4  # at most this many replicas removed per decision; 0 = no step limit

    # --- activation (scale from zero) ---
    coactivate_roles: bool = True  # a request woken from zero needs both roles: activating one wakes the other

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"invalid autoscaler config: {what}")

        need(self.tick_s > 0, f"tick_s={self.tick_s} must be > 0")
        need(self.target_queued_prompt_tokens_per_replica > 0, "target_queued_prompt_tokens_per_replica must be > 0")
        need(self.target_running_streams_per_replica > 0, "target_running_streams_per_replica must be > 0")
        need(0 < self.target_kv_utilisation <= 1, f"target_kv_utilisation={self.target_kv_utilisation} not in (0, 1]")
        need(self.target_queue_wait_p99_s >= 0, "target_queue_wait_p99_s must be >= 0 (0 disables)")
        for name in ("slo_ttft_s", "slo_tpot_s", "slo_queue_wait_s", "scale_to_zero_after_s"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
                 f"{name}={v!r} must be a number >= 0 (0 disables)")  # fmt: skip
        need(isinstance(self.pool_size, int) and not isinstance(self.pool_size, bool) and self.pool_size >= 0,
             f"pool_size={self.pool_size!r} must be an int >= 0")  # fmt: skip
        for role in SIZED:
            lo, hi = self.bounds(role)
            need(isinstance(lo, int) and lo >= 0, f"{role}_min_replicas={lo} must be an int >= 0")
            need(isinstance(hi, int) and hi >= 1, f"{role}_max_replicas={hi} must be an int >= 1")
            need(lo <= hi, f"{role}_min_replicas={lo} > {role}_max_replicas={hi}")
        need(self.panic_window_s > 0, "panic_window_s must be > 0")
        need(self.panic_window_s < self.stable_window_s, "panic_window_s must be < stable_window_s")
        need(self.slo_window_s >= 0, "slo_window_s must be >= 0")
        need(self.panic_threshold > 1, f"panic_threshold={self.panic_threshold} must be > 1")
        need(self.scale_down_delay_s >= 0, "scale_down_delay_s must be >= 0")
        need(0 < self.max_scale_down_fraction <= 1, "max_scale_down_fraction must be in (0, 1]")
        need(isinstance(self.max_scale_down_step, int) and self.max_scale_down_step >= 0,
             "max_scale_down_step must be an int >= 0")  # fmt: skip

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) replicas of `role`."""
        if role not in SIZED:
            raise ValueError(f"unknown role {role!r}: one of {', '.join(SIZED)}")
        return getattr(self, f"{role}_min_replicas"), getattr(self, f"{role}_max_replicas")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> AutoscalerConfig:
        """From a TOML table or string map (ConfigMap, flags): known keys only, coerced to each field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - set(fields))
        if unknown:
            raise ValueError(f"unknown autoscaler config keys: {', '.join(unknown)}")
        defaults, kw = cls(), {}
        for key, value in m.items():
            kw[key] = _coerce(key, value, type(getattr(defaults, key)))
        return cls(**kw)


def _coerce(key: str, value: Any, kind: type) -> Any:
    """`value` (a TOML value or a string) as `kind` (bool, int or float), or ValueError naming the key."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.strip().lower() in ("1", "true", "yes", "on")
    elif not isinstance(value, bool):
        try:
            number = float(value)
            if kind is float or number.is_integer():
                return kind(number)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"autoscaler config {key}={value!r}: expected {kind.__name__}")
