"""What test_policy.py and test_slo.py share: a config builder and a fake-clock cluster that obeys each decision."""

from __future__ import annotations

from autoscaler import AutoscalerConfig, PolicyContext, PolicyState, RoleLoad, decide

TOKENS = 1000  # prefill target per replica in these tests


def config(**kw) -> AutoscalerConfig:
    base = {
        "tick_s": 1.0,
        "target_queued_prompt_tokens_per_replica": TOKENS,
        "target_running_streams_per_replica": 10,
        "target_kv_utilisation": 0.5,
        "target_queue_wait_p99_s": 0.0,
        "prefill_min_replicas": 1,
        "prefill_max_replicas": 32,
        "decode_min_replicas": 1,
        "decode_max_replicas": 32,
        "stable_window_s": 60.0,
        "panic_window_s": 6.0,
        "panic_threshold": 2.0,
        "scale_down_delay_s": 30.0,
        "max_scale_down_fraction": 0.5,
        "max_scale_down_step": 4,
    }
    return AutoscalerConfig(**(base | kw))


M = "m"  # the model of the single-model tests
P, D = (M, "prefill"), (M, "decode")


class Sim:
    """A fake clock and a cluster whose replicas follow the decision at once (all ready), per (model, role)."""

    def __init__(self, cfg: AutoscalerConfig, prefill: int = 1, decode: int = 1, capacity=None, **more: int):
        """`capacity(replicas) -> (CapacityBound, ...)`: the actuator's bounds each tick (none by default)."""
        self.cfg, self.t, self.state, self.capacity = cfg, 0.0, PolicyState(), capacity
        self.replicas = {P: prefill, D: decode}  # more: {"model__role": n} for other models
        self.replicas.update({tuple(k.split("__")): n for k, n in more.items()})
        self.history: list = []

    def step(self, loads: dict | None = None):
        """One tick; `loads` {key: RoleLoad kwargs, or a function of the replicas serving}; other keys idle."""
        self.t += self.cfg.tick_s
        ctx = {}
        for key, n in self.replicas.items():
            kw = (loads or {}).get(key)
            kw = kw(n) if callable(kw) else kw  # load may depend on the replicas serving it
            ctx[key] = RoleLoad(model=key[0], replicas=n, ready=n, t=self.t, **(kw or {}))
        bounds = tuple(self.capacity(dict(self.replicas))) if self.capacity else ()
        d, self.state = decide(PolicyContext(self.cfg, ctx, self.t, bounds), self.state)
        self.replicas.update(d.replicas)
        self.history.append(d)
        return d

    def tick(self, prefill: dict | None = None, decode: dict | None = None):
        return self.step({P: prefill, D: decode})

    def run(self, ticks: int, **kw):
        return [self.tick(**kw) for _ in range(ticks)]

    def of(self, model: str = M) -> dict[str, int]:
        return {r: n for (m, r), n in self.replicas.items() if m == model}


def rep(d, model: str = M) -> dict[str, int]:
    """A decision's replicas of one model, by role."""
    return {r: n for (m, r), n in d.replicas.items() if m == model}


def tokens(n: int) -> dict:
    return {"queued_prompt_tokens": n, "queue_depth": max(1, n // 500) if n else 0}


def streams(n: int, capacity: float | None = None, **kw) -> dict:
    return {"running_streams": n, "capacity_streams": capacity, **kw}
