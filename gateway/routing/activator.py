"""The activator: a request for a model that no ready node holds is held, not refused, while the
model is placed (Knative's activator, per model).

Lifecycle of a held request:
 1. no route for its model (``router.pick`` over ``NodeRegistry.views(model)``): held — counted
    in ``held[model]`` (the autoscaler reads it in /internal/status: a held request is demand);
 2. ``activate(model)`` is called when the hold starts, then at most every ``interval_s`` while
    requests of that model are held (`pdserve up` wires it to the control loop's wake: the
    autoscaler places the model at once instead of at its next tick); it may be None;
 3. the registry is re-read every ``poll_s`` while anything is held (a node that just loaded
    the model is seen in ~0.1 s, not at the next 0.5 s health poll), and a registry change
    (a node registered or newly routable) ends the wait at once;
 4. a route appears before the deadline: the request goes on (its first token flows as soon as
    the node is ready); the deadline passes first: ``NotPlaced`` -> HTTP 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import Gauge

from gateway.routing.router import PullCost, Route, pick

log = logging.getLogger("pdserve.gateway")
HELD = Gauge("pdserve_gateway_held", "Requests held: no ready node holds their model yet", ["model"])
RETRY_AFTER_MAX_S = 5  # a placement takes seconds: retry within this, never later than the hold's length


class NotPlaced(Exception):
    """No node held the request's model within its deadline (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Activator:
    def __init__(self, registry, interval_s: float = 0.5, poll_s: float = 0.1, clock=time.monotonic,
                 pull: PullCost | None = None):  # fmt: skip
        self.registry = registry
        self.pull = pull  # a node may pull a prompt's cached prefix from a peer (router.PullCost); None: never
        self.activate: Callable[[str], object] | None = None  # ask for `model` to be placed (may be None)
        self.interval_s, self.poll_s, self.clock = interval_s, poll_s, clock
        self.held: dict[str, int] = {}  # model -> requests held now
        self._called: dict[str, float] = {}  # model -> when activate was last called for it
        self._tasks: set[asyncio.Task] = set()

    def route(self, model: str | None, exclude: frozenset[str] | set[str] = frozenset(),
              prompt: list[int] | None = None, salt: str | None = None, adapter: str | None = None) -> Route | None:  # fmt: skip
        """A route for `model` now (None: any node, the one-model gateway of old), or None. With the request's
        `prompt` (and `cache_salt`), scored by each node's cached prefix too (the registry's prefix index),
        and the prompt's blocks recorded on the node chosen (what this gateway sent where); ``adapter``: the
        request's LoRA adapter (NAME@vN), warm where a node keeps it."""
        views = self.registry.views(model or None)
        index = getattr(self.registry, "index", None)
        match = index.match(model, prompt, salt) if index is not None and model and prompt else None
        hits, n = (match.hits, len(prompt)) if match is not None else ({}, len(prompt or ()))
        pull = self.pull if match is not None else None
        route = pick(views, exclude, hits, n, pull=pull, adapter=adapter)
        if route is None and exclude:  # every node failed once: allow them again rather than give up
            route = pick(views, frozenset(), hits, n, pull=pull, adapter=adapter)
        if route is not None and match is not None:
            index.record(match, route.both or route.prefill)
        return route

    def held_total(self) -> int:
        return sum(self.held.values())

    async def hold(self, model: str | None, deadline: float, exclude: frozenset[str] | set[str] = frozenset(),
                   prompt: list[int] | None = None, salt: str | None = None, adapter: str | None = None) -> Route:  # fmt: skip
        """A route for `model` (by `prompt`'s cached prefix too: ``route``), waiting (held) until `deadline`
        (monotonic) for one; else NotPlaced."""
        route = self.route(model, exclude, prompt, salt, adapter)
        if route is not None:
            return route
        key = model or ""
        t0 = self.clock()
        self.held[key] = self.held.get(key, 0) + 1
        HELD.labels(key).set(self.held[key])
        self._called.pop(key, None)  # the hold starts: activate now
        try:
            while True:
                self._activate(key)
                left = deadline - self.clock()
                if left <= 0:
                    raise self._not_placed(key, self.clock() - t0)
                await self.registry.wait_changed(min(left, self.poll_s))
                route = self.route(model, exclude, prompt, salt, adapter)
                if route is None:
                    await self.registry.poll_stale(self.poll_s)
                    route = self.route(model, exclude, prompt, salt, adapter)
                if route is not None:
                    log.info("model %s: held request routed after %.2f s", key or "-", self.clock() - t0)
                    return route
        finally:
            self.held[key] -= 1
            HELD.labels(key).set(self.held[key])
            if not self.held[key]:
                del self.held[key]

    def _activate(self, model: str) -> None:
        fn = self.activate
        now = self.clock()
        if fn is None or now - self._called.get(model, -math.inf) < self.interval_s:
            return
        self._called[model] = now
        try:
            out = fn(model)
            if inspect.isawaitable(out):
                task = asyncio.ensure_future(out)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except Exception:  # a failing hook must not fail the held request
            log.exception("activate(%r) failed", model)

    def _not_placed(self, model: str, waited: float) -> NotPlaced:
        retry = max(1, min(RETRY_AFTER_MAX_S, math.ceil(waited)))
        what = f"model {model!r}" if model else "the model"
        if self.activate is None:
            why = f"no ready node holds {what} (waited {waited:.1f} s; nothing here can place it)"
        else:
            why = f"{what} is not loaded on any ready node yet: held {waited:.1f} s while it is placed"
        return NotPlaced(f"{why}; retry after {retry} s", retry)
