"""Processes read from /proc (Linux): whether a pid still runs as the same process (its start time, so a
reused pid does not count), the children of a pid, a bounded wait for a set of them to end, and SIGKILL
for whatever of a set is left. A set is ``{pid: start time}``, taken while each one ran."""

from __future__ import annotations

import os
import signal
import time


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... starttime at [19]
    except OSError:
        return None


def started(pid: int) -> str | None:
    """The start time of `pid` while it runs (a zombie has ended), else None."""
    st = _stat(pid)
    return st[19] if st and st[0] != "Z" else None


def children(pid: int) -> dict[int, str]:
    """{child pid: its start time} of every live process whose parent is `pid`."""
    out = {}
    for d in os.listdir("/proc"):
        st = _stat(int(d)) if d.isdigit() else None
        if st and int(st[1]) == pid and st[0] != "Z":
            out[int(d)] = st[19]
    return out


def alive(pids: dict[int, str]) -> list[int]:
    """The pids still running as the same process (one that did not run when its start was taken: never)."""
    return [p for p, start in pids.items() if start is not None and started(p) == start]


def wait_gone(pids: dict[int, str], timeout: float) -> float:
    """Seconds until none of `pids` runs; AssertionError after `timeout`."""
    t0 = time.monotonic()
    while alive(pids):
        assert time.monotonic() - t0 < timeout, f"still running after {timeout:g} s: {alive(pids)}"
        time.sleep(0.02)
    return time.monotonic() - t0


def kill_left(pids: dict[int, str]) -> None:
    for p in alive(pids):
        os.kill(p, signal.SIGKILL)
