"""One supervised local node: its slot (which outlives restarts), its process, and how it ended.

A ``Slot`` is what the kubelet calls a pod: ``decode-0`` keeps its restart backoff, how its last
node ended and that node's last log lines across restarts. A ``LocalNode`` is one process in a
slot, from spawn (``loading``) through ``/ready`` (``ready``) to ``stopping``. The actuator
(``autoscaler.local``) owns both and all their threads; this module only holds their state and
the words `pdserve status` shows for them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from .actuator import NodeInfo
from .backoff import RestartBackoff

LOG_TAIL_LINES = 10  # of a node that exited, kept for `pdserve status`


@dataclass(slots=True, eq=False)
class Slot:
    """A supervised place for one node of a role, across its restarts (a pod, to the kubelet)."""

    name: str  # e.g. "decode-0"
    role: str
    backoff: RestartBackoff
    last_exit: str = ""  # how its last node ended, in words
    last_log: tuple[str, ...] = ()  # the last lines of that node's log


@dataclass(slots=True, eq=False)
class LocalNode:
    """One `pdserve node` process this actuator spawned, in its slot."""

    role: str
    port: int
    proc: subprocess.Popen
    url: str
    slot: Slot
    log_path: str
    ready: bool = False
    state: str = "loading"  # loading | ready | stopping
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    why: str = ""  # why we killed it ourselves (not ready in time), else "": its exit status says

    def info(self) -> NodeInfo:
        return NodeInfo(self.role, self.url, self.ready, name=f"pid {self.proc.pid}", state=self.state)


def slot_row(s: Slot, state: str, pid: int | None, url: str, now: float) -> dict:
    """One row of `pdserve status`: the slot, its node (pid, url) or pending restart, its crash loop."""
    crashes = s.backoff.failures
    return {"slot": s.name, "role": s.role, "state": state, "pid": pid, "url": url, "restarts": s.backoff.restarts,
            "crashes": crashes, "restart_in_s": round(s.backoff.waiting(now), 1) if pid is None else None,
            "last_exit": s.last_exit, "last_log": list(s.last_log) if crashes else []}  # fmt: skip


def describe_exit(returncode: int) -> str:
    """A process's exit status in words: "killed by SIGKILL", "exited with code 2"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last non-blank lines of a log file (from its last 8 KiB); () if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ()
    return tuple(ln for ln in text.splitlines() if ln.strip())[-lines:]


def send_signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal a process that may have ended already."""
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
