"""The actuator contract: what the control loop needs from whatever runs the nodes.

An actuator owns a set of nodes per key and nothing else: it does not decide (policy.py
does) and does not loop (loop.py does). The loop calls it from one thread, once per tick;
an implementation need not be thread-safe beyond that. There are two levels, one contract:

  runtime actuators  keyed by role ("decode"): `scale(role, n, prefer_remove=(urls...))` runs n
                     node runtimes (processes, pods) of that role, empty (standby) or not;
                     `current()` -> {role: [NodeInfo]}. The backends below.
  the warm pool      keyed by (model, role): autoscaler/pool.py `RuntimePool` over a runtime
                     actuator — a replica of (m, r) is a runtime of role r holding model m;
                     `scale((m, r), n)` claims standby runtimes (inject m) or unloads m
                     (the runtime returns to the pool). This is what the loop drives.

Backends, registered in `make_actuator` and imported lazily by name:
  local       autoscaler/local.py       `pdserve node` processes on this machine (`pdserve up`)
  kubernetes  autoscaler/kubernetes.py  the prefill/decode Deployments' scale subresource
  fake        autoscaler/fake.py        an in-memory twin for tests, no processes, no network

Errors are split by what the loop should do next (kopf's shape): TemporaryActuatorError
— back off and try again (a 500, a timeout); PermanentActuatorError — retrying will not
help until someone fixes something (403, missing Deployment); the loop reports it and
keeps running either way.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass


class ActuatorError(Exception):
    """An actuator could not observe or act."""


class TemporaryActuatorError(ActuatorError):
    """Worth retrying after a while; `delay` (s) overrides the loop's backoff when set."""

    def __init__(self, message: str, delay: float | None = None):
        super().__init__(message)
        self.delay = delay


class PermanentActuatorError(ActuatorError):
    """Retrying is useless until the configuration or the cluster is fixed (RBAC, a missing Deployment)."""


@dataclass(slots=True, frozen=True)
class NodeInfo:
    """One node as its actuator sees it — what the gateway's node registry needs."""

    role: str  # "prefill" | "decode" | "both"
    url: str  # base URL of the node's HTTP server, e.g. http://10.0.0.7:8001
    ready: bool  # readiness: weights loaded and accepting requests
    name: str = ""  # process id / pod name, for logs and `pdserve status`
    state: str = ""  # "loading" | "ready" | "draining" where the backend knows it; "" otherwise


class Actuator(abc.ABC):
    """Runs nodes per role. Calls come from the control loop's thread, one at a time."""

    @abc.abstractmethod
    def current(self) -> dict[str, list[NodeInfo]]:
        """The nodes that exist now, per role, ready or not (starting nodes have ready=False).

        Raises TemporaryActuatorError / PermanentActuatorError; never returns a partial view
        silently.
        """

    @abc.abstractmethod
    def scale(self, role: str, replicas: int, prefer_remove: tuple[str, ...] = ()) -> None:
        """Ask for `replicas` nodes of `role`; returns once the request is accepted, not when nodes are ready.

        Idempotent: scaling to the current count is a no-op. On scale-down the backend
        removes the nodes whose URL is in `prefer_remove` first, in that order (the pool's
        standby runtimes), then picks the rest itself, and drains them (stop accepting,
        finish or hand back in-flight requests, then exit) — no request is lost. (The pool,
        keyed by (model, role), takes no `prefer_remove`: it chooses its own runtimes.)
        """

    # --- optional hooks, with safe defaults ---

    def replicas(self, role: str) -> int:
        """Nodes of `role` asked for (ready + starting); by default the count `current()` sees."""
        return len(self.current().get(role, []))

    def prepare(self, role: str, replicas: int) -> None:
        """Called before scaling `role` up to `replicas`: e.g. ask the parameter store to pre-stage
        (warm) the model's shards where the new nodes will read them. Default: nothing."""

    def capacity(self, serving: tuple[str, ...] | None = None) -> tuple:
        """The bounds on serving nodes this actuator's machine or cluster puts now (autoscaler/capacity.py
        ``CapacityBound``s; the policy never plans past them). ``serving``: the URLs of the nodes that hold a
        model, where the caller (the warm pool) knows; None: the actuator counts. Default: none."""
        return ()

    def drain(self, node: NodeInfo) -> None:
        """Drain one node now (stop accepting, finish in-flight, exit). Default: unsupported here."""
        raise NotImplementedError(f"{type(self).__name__} drains nodes through scale()")

    def close(self) -> None:
        """Release clients and connections. Default: nothing."""


_BACKENDS = {  # kind -> (module, class); imported only when asked for
    "local": ("autoscaler.local", "LocalActuator"),
    "kubernetes": ("autoscaler.kubernetes", "KubernetesActuator"),
    "fake": ("autoscaler.fake", "FakeActuator"),
}


def actuator_kinds() -> list[str]:
    """The registered backend names (nothing is imported)."""
    return sorted(_BACKENDS)


def make_actuator(kind: str, **kw) -> Actuator:
    """The actuator registered as `kind`, built with `kw` (its own config fields)."""
    try:
        module, name = _BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown actuator {kind!r}: one of {', '.join(sorted(_BACKENDS))}") from None
    return getattr(importlib.import_module(module), name)(**kw)
