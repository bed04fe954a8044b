"""FakeActuator: the in-memory twin of a real actuator, for tests and dry runs.

Key-generic: a key is a role ("decode": the twin of a runtime actuator) or a (model, role)
tuple (the twin of the warm pool the control loop drives); a node's NodeInfo.role is the
key's role either way. Nodes are records, not processes: a scaled-up node is "loading"
until `start_delay_s` has passed on the injected clock, then ready. Scale-down removes the nodes named in
`prefer_remove` first, then starting nodes, then the newest ready ones (as a ReplicaSet
does), and records each removed node in `drained`. Every call is recorded in `calls`; `fail_next` queues errors the
next calls raise, to exercise the loop's backoff.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from .actuator import Actuator, NodeInfo

Key = Hashable  # "decode" or ("smollm2", "decode")


def _role(key: Key) -> str:
    return key[-1] if isinstance(key, tuple) else str(key)


def _label(key: Key) -> str:
    return "-".join(key) if isinstance(key, tuple) else str(key)


@dataclass(slots=True)
class _Node:
    name: str
    url: str
    started: float


class FakeActuator(Actuator):
    def __init__(self, replicas: dict[Key, int] | None = None, start_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.start_delay_s = start_delay_s
        self.clock = clock
        self.nodes: dict[Key, list[_Node]] = {}
        self.calls: list[tuple] = []  # ("scale", key, n) | ("prepare", key, n) | ("current",)
        self.drained: list[NodeInfo] = []
        self._errors: list[BaseException] = []
        self._ids = itertools.count()
        for key, n in (replicas or {}).items():
            self._resize(key, n, started=float("-inf"))  # initial nodes are ready at once

    def fail_next(self, *errors: BaseException) -> None:
        """The next len(errors) calls to current/scale/replicas raise these, in order."""
        self._errors.extend(errors)

    def _maybe_fail(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    def _info(self, key: Key, n: _Node) -> NodeInfo:
        ready = self.clock() - n.started >= self.start_delay_s
        return NodeInfo(role=_role(key), url=n.url, ready=ready, name=n.name, state="ready" if ready else "loading")

    def _resize(self, key: Key, replicas: int, started: float, prefer_remove: tuple[str, ...] = ()) -> None:
        nodes = self.nodes.setdefault(key, [])
        while len(nodes) < replicas:
            i = next(self._ids)
            nodes.append(_Node(name=f"{_label(key)}-{i}", url=f"http://127.0.0.1:{9000 + i}", started=started))
        while len(nodes) > replicas:
            # starting nodes first, then the newest ready one
            infos = [self._info(key, n) for n in nodes]
            pick = next((i for i in range(len(nodes)) if nodes[i].url in prefer_remove), None)  # named ones first
            if pick is None:
                pick = next((i for i in reversed(range(len(nodes))) if not infos[i].ready), len(nodes) - 1)
            gone = nodes.pop(pick)
            self.drained.append(NodeInfo(role=_role(key), url=gone.url, ready=False, name=gone.name, state="draining"))

    def current(self) -> dict[Key, list[NodeInfo]]:
        self.calls.append(("current",))
        self._maybe_fail()
        return {key: [self._info(key, n) for n in nodes] for key, nodes in self.nodes.items()}

    def replicas(self, key: Key) -> int:
        self._maybe_fail()
        return len(self.nodes.get(key, []))

    def scale(self, key: Key, replicas: int, prefer_remove: tuple[str, ...] = ()) -> None:
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        self.calls.append(("scale", key, replicas))
        self._maybe_fail()
        self._resize(key, replicas, started=self.clock(), prefer_remove=tuple(prefer_remove))

    def prepare(self, key: Key, replicas: int) -> None:
        self.calls.append(("prepare", key, replicas))
