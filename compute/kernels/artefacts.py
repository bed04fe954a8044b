"""A machine-class artefact on one node: the store's copy, this machine's cache, one builder under a lock.

Kernel plans (``compute.kernels.plans``: measured) and compiled step graphs (``compute.node.graph_builder``:
compiled) belong to a class of machine, not to a node. Each is taken by a ``Builder`` thread, off the request path:
 1. ``start``: a daemon thread, niced (it, and the processes it starts, yield the CPU to the serving threads);
 2. ``take``: this machine's cached copy (another process of the machine built it); else, under the machine's
    lock (a file beside the cache, ``machine_lock``; the other processes poll the cache meanwhile, and one of
    them takes the lock over if its holder dies), the cache again, then the store's copy (``fetch``: one log
    line, never trusted, if it is corrupt, unsigned where the store signs or unreachable), else one built here;
 3. a copy built here is saved in the cache and published (``publish``: one log line where the store cannot take
    it), so that no other node of the class builds it, and handed to the kind's callback, which posts it to the
    engine thread: the swap happens there, between two steps, after the engine re-checks it still fits;
 4. ``stop``: the thread ends after its slice; ``interrupt`` cuts short what a slice cannot (a builder process).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("pdserve.node")
NICE = 19  # a builder thread's niceness (and that of what it starts): serving threads come first
T = TypeVar("T")


def yield_cpu(tid: int = 0) -> str:
    """Run thread ``tid`` (0: the caller; a process's main thread: the process, and what it starts after) only
    when nothing else wants the CPU: SCHED_IDLE, which a waking serving thread preempts at once. Nice 19 alone
    does not: an OpenMP decode step waits at ~200 barriers for a thread woken behind a niced compiler's slice
    (measured, 2 cores: 20 tok/s fell to 2.7 while a step graph built at nice 19). -> "idle", else "nice" where
    the policy cannot be set (nice 19 then)."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
        return "nice"


@contextlib.contextmanager
def machine_lock(path: str | None, block: bool):
    """The machine's lock on one artefact (a file, locked with ``flock``: released when the holder closes it or
    dies): yields True if held, False if another process holds it and ``block`` is False. No path: nothing to
    share, always True."""
    if not path:
        yield True
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(what: str, oid: str, read: Callable[[], T]) -> T | None:
    """``read()``: an artefact from the store; None if the store has none, and None with one log line if its copy
    is corrupt, unsigned where the store signs, tampered or unreachable (never trusted)."""
    from paramstore.errors import NotFound, StoreError

    try:
        return read()
    except NotFound:
        return None
    except (StoreError, OSError) as e:
        log.warning("%s %s in the store ignored: %s", what, oid, e)
        return None


def publish(objects, what: str, oid: str, write: Callable[[], dict]) -> dict | None:
    """``write()``: an artefact into the store's ``objects`` -> the body written; None, with one log line, where
    the store takes only the publisher's signature and this process has none, or it cannot take it."""
    from paramstore.errors import StoreError

    if not getattr(objects, "can_publish", True):
        log.info("%s %s kept on this machine: the store takes %s signed by the publisher key only", what, oid,
                 getattr(objects, "plural", "objects"))  # fmt: skip
        return None
    try:
        return write()
    except (StoreError, OSError) as e:
        log.warning("%s %s not published to the store: %s", what, oid, e)
        return None


class Builder(ABC):
    """One artefact builder's thread (module doc): ``start``, ``stop``, ``wait``; a kind writes ``run``."""

    def __init__(self, name: str, nice: int = NICE) -> None:
        self.nice = nice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    @abstractmethod
    def run(self) -> None:
        """The thread's work, niced; it returns soon after ``self._stop`` is set."""

    def interrupt(self) -> None:
        """Cut short what the thread waits on that ``self._stop`` does not end (called by ``stop``)."""

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the current slice; True once the thread has ended (or never started)."""
        self._stop.set()
        self.interrupt()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def take(self, cached: Callable[[], T | None], lock: str | None, fetch: Callable[[], T | None] | None,
             build: Callable[[], T | None], poll_s: float) -> tuple[T | None, str]:  # fmt: skip
        """(the artefact, how it came): "cached" (on this machine at once), "peer" (another process of the machine
        built it while this one waited), "store", "built" (here, holding ``lock``); (None, "") once stopped.
        ``cached()`` / ``fetch()``: the machine's / the store's copy, saved in the cache, or None; ``build()``
        saves what it builds. An ``OSError`` of the lock's file is the caller's (an unusable cache)."""
        waited = False
        while not self._stop.is_set():
            got = cached()
            if got is not None:
                return got, "peer" if waited else "cached"
            with machine_lock(lock, block=False) as held:
                if held:
                    got = cached()  # finished between the look and the lock
                    if got is not None:
                        return got, "peer"
                    got = fetch() if fetch is not None else None
                    return (got, "store") if got is not None else (build(), "built")
            waited = True
            self._stop.wait(poll_s)
        return None, ""

    def _main(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # this thread (its OMP team, the processes it starts)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        self.run()
