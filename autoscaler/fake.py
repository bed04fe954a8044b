"""FakeActuator: the in-memory twin of a real actuator, for tests and dry runs.

Nodes are records, not processes: a scaled-up node is "loading" until `start_delay_s`
has passed on the injected clock, then ready. Scale-down removes starting nodes
first, then the newest ready ones (as a ReplicaSet does), and records each removed
node in `drained`. Every call is recorded in `calls`; `fail_next` queues errors the
next calls raise, to exercise the loop's backoff.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from .actuator import Actuator, NodeInfo


@dataclass(slots=True)
class _Node:
    name: str
    url: str
    started: float


class FakeActuator(Actuator):
    def __init__(self, replicas: dict[str, int] | None = None, start_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.start_delay_s = start_delay_s
        self.clock = clock
        self.nodes: dict[str, list[_Node]] = {}
        self.calls: list[tuple] = []  # ("scale", role, n) | ("prepare", role, n) | ("current",)
        self.drained: list[NodeInfo] = []
        self._errors: list[BaseException] = []
        self._ids = itertools.count()
        for role, n in (replicas or {}).items():
            self._resize(role, n, started=float("-inf"))  # initial nodes are ready at once

    def fail_next(self, *errors: BaseException) -> None:
        """The next len(errors) calls to current/scale/replicas raise these, in order."""
        self._errors.extend(errors)

    def _maybe_fail(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    def _info(self, role: str, n: _Node) -> NodeInfo:
        ready = self.clock() - n.started >= self.start_delay_s
        return NodeInfo(role=role, url=n.url, ready=ready, name=n.name, state="ready" if ready else "loading")

    def _resize(self, role: str, replicas: int, started: float) -> None:
        nodes = self.nodes.setdefault(role, [])
        while len(nodes) < replicas:
            i = next(self._ids)
            nodes.append(_Node(name=f"{role}-{i}", url=f"http://127.0.0.1:{9000 + i}", started=started))
        while len(nodes) > replicas:
            # starting nodes first, then the newest ready one
            infos = [self._info(role, n) for n in nodes]
            pick = next((i for i in reversed(range(len(nodes))) if not infos[i].ready), len(nodes) - 1)
            gone = nodes.pop(pick)
            self.drained.append(NodeInfo(role=role, url=gone.url, ready=False, name=gone.name, state="draining"))

    def current(self) -> dict[str, list[NodeInfo]]:
        self.calls.append(("current",))
        self._maybe_fail()
        return {role: [self._info(role, n) for n in nodes] for role, nodes in self.nodes.items()}

    def replicas(self, role: str) -> int:
        self._maybe_fail()
        return len(self.nodes.get(role, []))

    def scale(self, role: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        self.calls.append(("scale", role, replicas))
        self._maybe_fail()
        self._resize(role, replicas, started=self.clock())

    def prepare(self, role: str, replicas: int) -> None:
        self.calls.append(("prepare", role, replicas))
