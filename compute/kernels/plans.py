"""Where a node's int8 kernel plan comes from, and measuring a better one off the request path.

A kernel plan (``compute.kernels.int8``' table) belongs to a class of machine (CPU model, ISA flags, torch's
dispatch level, torch version, threads), not to a node: like weights, it comes from the store.

Lifecycle of one model's kernels (``compute/modeling/loader.py`` runs 1-2 once the weights are in, the node 3-4):
 1. ``lookup``: the plan published in the parameter store for this machine key (``paramstore plans``),
    else the table cached on this machine (``int8.json``), if either holds every shape of the model;
    a plan that is corrupt, unsigned where the store signs, of another table version or machine key is
    ignored with one log line, never trusted. Never a measurement;
 2. without one, the safe rule (``rule_table``: the native kernel up to M = 64 where it is built, else int8mm;
    dequant beyond; native (else int8mm) at every M under ``invariant``): correct on every CPU. The model is ready
    and serves at once, at the memory bandwidth for decode;
 3. a ``BackgroundMeasure`` thread (an ``artefacts.Builder``, as step graphs are) measures what the plan lacks:
    one process per machine (the lock beside the cache file; the others poll the cache for its result and take
    over if it dies), niced to 19, in slices of milliseconds (``int8.measure_steps``), sleeping between slices
    so that it takes at most ``share`` of the time while the engine has work (full speed while it is idle); each
    measured shape is saved at once (progress survives the process);
 4. the table is saved, published to the store (so no other node of this class measures; a store the
    node cannot write is one log line), and handed to ``apply``: the node swaps it in on its engine thread
    between two steps (``measured``), or — ``invariant`` — only if it has not served a request yet (a
    request's numbers never depend on when it arrived).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from compute.kernels import artefacts, int8

log = logging.getLogger("pdserve.node")
SHAPES_MEASURED = Counter("pdserve_node_kernel_shapes_measured_total",
                          "Weight shapes this process measured int8 kernels for (0 on a node whose plan came "
                          "from the store or the machine's cache)")  # fmt: skip
PLANS = Counter("pdserve_node_kernel_plans_total", "Kernel plans a model was served with, by where they came "
                "from: store | local | rule (before a measurement) | measured | peer (another process's)", ["source"])  # fmt: skip
RULE_INT8MM_MAX_M = 64  # the safe rule (``fixed``, and before a plan is known): native / int8mm up to this M, dequant beyond
_LIVE: weakref.WeakSet = weakref.WeakSet()  # measurements running in this process


@atexit.register
def stop_all() -> None:
    """End every measurement of this process after its slice: at exit (a thread inside a torch op at interpreter
    teardown aborts the process: "terminate called without an active exception"), or before a caller counts
    measurements of its own."""
    for m in list(_LIVE):
        m.stop()


def rule_table(shapes: Iterable[tuple[int, int]], threads: int) -> dict:
    """The safe rule as a table, usable at once on any CPU without measuring: the native kernel (else int8mm) up to
    M = 64 and dequant beyond (correct on every dispatch level, ``compute/kernels/linear.py``), and the same kernel at
    every M as the ``invariant`` one (its output's K loop does not depend on M); dequant where neither is usable.
    The native kernel led int8mm at every M <= 64 on each CPU measured (1.2-1.7x on AVX-512, 7x on the head)."""
    out = {}
    for n, k in sorted(set(shapes)):
        small = next((c for c in ("native", "int8mm") if int8.usable(c, n, k)), None)
        choice = [(small if small and (hi is not None and hi <= RULE_INT8MM_MAX_M) else "dequant") for hi in int8.BUCKETS]
        out[f"{n}x{k}"] = {"choice": choice, "us": {}, "error": {}, "row_invariant": {}, "invariant": small}
    return {"version": int8.TABLE_VERSION, "key": int8.machine_key(threads), "probe_m": list(int8.PROBE_M),
            "buckets": [b or "inf" for b in int8.BUCKETS], "error_gate": int8.ERROR_GATE, "shapes": out, "rule": True}  # fmt: skip


def complete(table: dict | None, shapes: Iterable[tuple[int, int]]) -> bool:
    """Whether ``table`` holds a measured entry for every shape."""
    have = (table or {}).get("shapes", {})
    return bool(table) and not table.get("rule") and all(f"{n}x{k}" in have for n, k in shapes)


def valid_table(table, threads: int) -> str | None:
    """Why ``table`` cannot plan this machine at ``threads`` (None: it can): another version, machine key
    (CPU, ISA flags, dispatch level, torch version, threads), or a malformed entry."""
    if not isinstance(table, dict) or table.get("version") != int8.TABLE_VERSION:
        return f"table version {table.get('version') if isinstance(table, dict) else '?'}, this torch's is {int8.TABLE_VERSION}"
    if table.get("key") != int8.machine_key(threads):
        return f"it is for {str(table.get('key')).split(' ', 1)[-1]!r}"
    shapes = table.get("shapes")
    if not isinstance(shapes, dict):
        return "no shapes"
    for name, e in shapes.items():
        ok = isinstance(e, dict) and isinstance(e.get("choice"), list) and len(e["choice"]) == len(int8.BUCKETS)
        if not ok or any(c not in int8.KERNELS for c in e["choice"]) or e.get("invariant") not in (None, *int8.KERNELS):
            return f"malformed entry {name!r}"
    return None


def lookup(shapes: Iterable[tuple[int, int]], threads: int, cache_path: str | None, store=None) -> tuple[dict | None, str]:
    """(table, "store" | "local") for ``shapes`` without measuring; (None, "") if no valid plan has them all."""
    shapes, key = sorted(set(shapes)), int8.machine_key(threads)
    if store is not None:
        table = _from_store(store, key, threads)
        if complete(table, shapes):
            return table, "store"
    try:
        local = int8.cached_table(threads, cache_path)
    except OSError:
        local = None
    why = None if local is None else valid_table(local, threads)
    if why:
        log.warning("kernel table in %s ignored: %s", cache_path, why)
    elif complete(local, shapes):
        return local, "local"
    return None, ""


def _from_store(store, key: str, threads: int) -> dict | None:
    pid = key.split(" ", 1)[0]
    table = artefacts.fetch("kernel plan", pid, lambda: store.plans.get(key)["table"])
    why = None if table is None else valid_table(table, threads)
    if why:
        log.warning("kernel plan %s in the store ignored: %s", pid, why)
        return None
    return table


def publish(store, table: dict, threads: int) -> bool:
    """Put ``table`` in the store as its machine key's plan (merged with the valid shapes already there)."""
    key = table["key"]

    def write() -> dict:
        shapes = (_from_store(store, key, threads) or {}).get("shapes", {})
        return store.plans.publish(key, {**table, "shapes": {**shapes, **table["shapes"]}})

    body = artefacts.publish(store.plans, "kernel plan", key.split(" ", 1)[0], write)
    if body is None:
        return False
    log.info("kernel plan %s published to the store (revision %d, %d shapes)", key.split(" ", 1)[0],
             body["revision"], len(body["table"]["shapes"]))  # fmt: skip
    return True


class BackgroundMeasure(artefacts.Builder):
    """Measures the shapes a model's plan lacks, off the request path (steps 3-4 above).

    ``busy()`` says whether the engine has work (pace to ``share``); ``apply(table, source)`` receives
    the result once, on this thread. ``state``: waiting (another process measures) | measuring | done |
    failed | stopped.
    """

    def __init__(self, shapes: Iterable[tuple[int, int]], threads: int, cache_path: str | None, store,
                 apply: Callable[[dict, str], None], busy: Callable[[], bool] = lambda: False,
                 share: float = 0.25, poll_s: float = 1.0, nice: int = 19, name: str = "kernels"):  # fmt: skip
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        super().__init__(f"{name}-measure", nice)
        self.shapes, self.threads, self.cache_path, self.store = sorted(set(shapes)), threads, cache_path, store
        self.apply, self.busy, self.share, self.poll_s = apply, busy, share, poll_s
        self.state, self.source, self.error = "waiting", "", None
        self.table: dict | None = None  # the result, once done
        self.measured_s = 0.0  # seconds of measuring work (excluding pauses)

    def start(self) -> "BackgroundMeasure":
        _LIVE.add(self)
        return super().start()

    # --- the measuring thread ---------------------------------------------------------
    def run(self) -> None:
        try:
            table, source = self._obtain()
            if table is None:
                self.state = "stopped"
                return
            if self.store is not None and source in ("measured", "local"):  # "peer": its measurer publishes
                publish(self.store, table, self.threads)
            self.state, self.source, self.table = "done", source, table
            self.apply(table, source)
        except Exception as e:  # noqa: BLE001 - the node keeps serving with the plan it has
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.warning("background kernel measurement failed (serving on with the current plan): %s", self.error)

    def _obtain(self) -> tuple[dict | None, str]:
        """The complete table: from the cache (another process measured it), or measured here under the lock."""
        while True:
            lock = int8.lock_path(self.cache_path)
            try:
                table, how = self.take(self._complete, lock, None, self._measure, self.poll_s)
            except OSError as e:  # an unwritable cache: measure for this process alone
                if not self.cache_path:
                    raise
                log.warning("kernel cache %s unusable (%s): measuring without it", self.cache_path, e)
                self.cache_path = None
                continue
            return table, {"cached": "local", "built": "measured"}.get(how, how)

    def _complete(self) -> dict | None:
        table = self._cached()
        return table if complete(table, self.shapes) else None

    def _cached(self) -> dict | None:
        try:
            t = int8.cached_table(self.threads, self.cache_path)
        except OSError:
            return None
        return t if t is not None and valid_table(t, self.threads) is None else None

    def _measure(self) -> dict | None:
        """The missing shapes, slice by slice, paced; each shape saved as it completes (we hold the lock)."""
        have = (self._cached() or {}).get("shapes", {})
        missing = [s for s in self.shapes if f"{s[0]}x{s[1]}" not in have]
        self.state = "measuring"
        log.info("measuring int8 kernels for %d shapes in the background (at most %.0f%% of the time while "
                 "serving)", len(missing), self.share * 100)  # fmt: skip
        t_start = time.perf_counter()
        done = [0]

        def saved(table: dict) -> None:
            SHAPES_MEASURED.inc(len(table["shapes"]) - done[0])
            done[0] = len(table["shapes"])
            int8.save_table(self.cache_path, table)

        steps = int8.measure_steps(missing, self.threads, on_shape=saved)
        t0 = time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as end:
                table = end.value
                break
            dt = time.perf_counter() - t0
            self.measured_s += dt
            if self._stop.is_set():
                return None
            if self.busy():  # the engine has work: pause so this thread takes at most `share` of the time
                self._stop.wait(dt * (1 - self.share) / self.share)
            t0 = time.perf_counter()
        table = int8.save_table(self.cache_path, table)
        log.info("kernel measurement done: %d shapes in %.1f s of work (%.1f s wall)", len(missing), self.measured_s,
                 time.perf_counter() - t_start)  # fmt: skip
        return table
