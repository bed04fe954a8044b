"""The engine thread of a node: one thread owns the engine; the HTTP side talks to it by message.

Only this thread calls the engine's verbs: it alone touches the engine's queues, the KV cache and the model (thread
confinement, no locks in the engine). The asyncio side:
  - ``call(fn)`` runs ``fn(engine)`` on the engine thread between two steps and
    returns an awaitable result (add a request, abort, export/import bookkeeping);
  - ``open_stream(seq_id)`` gives an ``asyncio.Queue`` that receives that request's
    ``StepOutput``s as the engine produces them (``loop.call_soon_threadsafe``).
A step that raises fails only its requests (the engine's own rule); the loop lives on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from prometheus_client import Histogram

from compute.engine.engine import Engine, StepOutput
from compute.node.metrics import GENERATED, PREFIX_EVICTIONS, PREFIX_HITS, PREFIX_QUERIES, PROMPT_COMPUTED

log = logging.getLogger("pdserve.node")
STEP_SECONDS = Histogram("pdserve_node_step_seconds", "One engine step",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))  # fmt: skip


class EngineWorker:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, idle_wait_s: float = 0.05,
                 meter=None, name: str = "engine", model: str = ""):  # fmt: skip
        self.engine, self.loop, self.idle_wait_s = engine, loop, idle_wait_s
        self._generated, self._prompt_computed = GENERATED.labels(model), PROMPT_COMPUTED.labels(model)
        self._prefix = (PREFIX_QUERIES.labels(model), PREFIX_HITS.labels(model), PREFIX_EVICTIONS.labels(model))
        self._prefix_seen = (0, 0, 0)  # the engine's prefix-cache counters at the last step
        self.meter = meter  # a CapacityMeter fed with every step (or None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, asyncio.Queue] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the engine thread (after its current step); True once it has ended."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    async def call(self, fn: Callable[[Engine], object]):
        """Run fn(engine) on the engine thread; returns its result or raises its exception."""
        fut = self.loop.create_future()

        def done(result=None, error=None):
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        self._inbox.put((fn, done))
        return await fut

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Fire and forget fn(engine) on the engine thread (safe from any thread)."""
        self._inbox.put((fn, lambda result=None, error=None: None))

    def open_stream(self, seq_id: int) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[seq_id] = q
        return q

    def close_stream(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)

    # --- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self._stop.is_set():
                break
            if self.engine.has_unfinished():
                t0, before = time.perf_counter(), self.engine.prompt_tokens_computed
                outs = self.engine.step()
                dt = time.perf_counter() - t0
                self._prompt_computed.inc(self.engine.prompt_tokens_computed - before)
                STEP_SECONDS.observe(dt)
                self._count_prefix()
                if self.meter is not None:
                    self.meter.record(*self.engine.last_step, dt)
                self.steps += 1
                self._dispatch(outs)

    def _count_prefix(self) -> None:
        st = self.engine.prefix_cache_stats()
        now = (st.queries, st.hits, st.evictions)
        for counter, new, old in zip(self._prefix, now, self._prefix_seen):
            if new > old:
                counter.inc(new - old)
        self._prefix_seen = now

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, done = item
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                self._reply(done, None, e)
            else:
                self._reply(done, result, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _reply(self, done, result, error) -> None:
        try:
            self.loop.call_soon_threadsafe(done, result, error)
        except RuntimeError:
            pass  # the event loop is closed: the node is shutting down

    def _dispatch(self, outs: list[StepOutput]) -> None:
        n = 0
        for o in outs:
            n += len(o.new_token_ids)
            q = self._streams.get(o.seq_id)
            if q is not None:
                self.loop.call_soon_threadsafe(q.put_nowait, o)
        if n:
            self._generated.inc(n)
