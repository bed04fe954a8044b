"""What the autoscaler sees of one (model, role) at one tick: its key and its ``RoleLoad``.

The observer (autoscaler/observer.py) fills a ``RoleLoad`` per key from the gateway's and the nodes' reports; the
SLO rules (autoscaler/slo.py) and the policy (autoscaler/policy.py) read it. A plain value: no behaviour here.
"""

from __future__ import annotations

from dataclasses import dataclass

Key = tuple[str, str]  # (model, role); a plain role ("decode") is read as ("", "decode"): one unnamed model


def key_str(key) -> str:
    """A key as JSON writes it: ("smollm2", "decode") -> "smollm2/decode" (a plain string stays as it is)."""
    return "/".join(key) if isinstance(key, tuple) else str(key)


def split_key(key) -> tuple[str, str]:
    """(model, role) of a key."""
    return key if isinstance(key, tuple) else ("", key)


@dataclass(slots=True)
class RoleLoad:
    """What the gateway and the nodes report for one (model, role), at time `t`."""

    replicas: int = 0  # replicas the actuator runs now (its spec: ready + starting)
    ready: int = 0  # replicas serving (readiness: weights loaded)
    starting: int = 0  # replicas started, not ready yet
    queue_depth: int = 0  # requests of this model waiting at the gateway (for admission, or held)
    queue_wait_p50_s: float = 0.0  # queue waiting time, median (s)
    queue_wait_p99_s: float = 0.0  # queue waiting time, p99 (s)
    queued_prompt_tokens: int = 0  # prefill: prompt tokens waiting or being prefilled
    running_streams: int = 0  # decode: streams being decoded
    kv_utilisation: float = 0.0  # decode: KV blocks used / total, mean over ready replicas, 0..1
    t: float = 0.0  # when this was observed (the loop's clock)
    model: str = ""  # the model this load is for
    held: int = 0  # requests of this model the gateway's activator holds (no node has it ready)
    node_queued: int = 0  # requests waiting inside the role's nodes (decode: for a batch slot or their KV)
    ttft_p99_s: float = 0.0  # time to first token, p99 over the gateway's last 60 s (0: no sample)
    tpot_p99_s: float = 0.0  # time per output token, p99, likewise
    idle_s: float = 0.0  # since the model's last request arrived or finished (gateway)
    capacity_streams: float | None = None  # decode: streams one ready replica carries within TPOT (measured)
    prefill_tokens_per_s: float | None = None  # prefill: prompt tokens/s of one ready replica (measured)
    decode_tokens_per_s: float | None = None  # decode: tokens/s of one ready replica at its SLO batch (measured)
    requests_per_s: float = 0.0  # arrivals of this model at the gateway, over its last 1-2 s
    prompt_tokens_per_s: float = 0.0  # prompt tokens of those arrivals per second
    output_tokens_per_s: float = 0.0  # output tokens those arrivals are expected to ask for, per second
    recent_requests: int = 0  # the arrivals those rates count (the gateway's last 2 s)
