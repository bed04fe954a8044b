"""Capacity: how many serving nodes the place the nodes run on can take, and the bound that puts on scale-up.

A replica on the same cores is not new capacity. Each tick the runtime actuator says what its machine
(or cluster) can run; the policy (policy.py, stage 6) never plans more serving nodes than that.

  Machine        this machine as a process sees it: usable cores (``os.sched_getaffinity`` and the
                 cgroup's ``cpu.max`` quota, the smaller), memory (the cgroup's ``memory.max`` less its
                 use, else ``MemAvailable``); read by ``machine()``.
  CpuMeter       the machine's busy cores over the last ``window_s`` (``/proc/stat``, the CPUs of our
                 affinity; the cgroup's own usage under a quota); a node's resident memory: ``rss_bytes``.
  CapacityBound  what one actuator reports: at most ``limit`` serving nodes (nodes holding a model) of
                 ``roles`` (empty: every role), ``serving`` now, which bound (``kind``: machine, memory,
                 schedulable) and ``why`` in words — the text the decision line and `pdserve status` show.
  machine_bound  the local rule, pure: a new serving node is planned only where half the cores of its
                 threads are idle as measured (``cores - busy >= threads / 2``: "a decode node claimed from the
                 pool uses the core a half-idle prefill node leaves"), and only where its memory fits (the
                 largest serving node's resident set). Never fewer than the static count ``cores // threads``
                 (what runs at full speed: a busy moment, a refill's imports, does not cut it), never more than
                 ``2 * cores // threads`` in all (each node at no less than half its cores).

Nothing here acts: the pool (pool.py) reports the bound with its serving count, the loop (loop.py) hands
it to the pure policy.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(slots=True, frozen=True)
class CapacityBound:
    """At most ``limit`` serving nodes of ``roles`` (() = all roles together); ``serving`` hold a model now."""

    kind: str  # which bound: "machine" (cores) | "memory" | "schedulable" (Kubernetes: pending pods)
    limit: int  # serving nodes at most
    serving: int  # serving nodes now (holding a model, loading or ready)
    why: str  # in words, e.g. "machine: 2 cores, 1 thread per node → at most 2 serving nodes"
    roles: tuple[str, ...] = ()  # the roles it bounds; () = every role (one machine)

    @property
    def room(self) -> int:
        """Serving nodes that may still be added."""
        return max(0, self.limit - self.serving)

    def covers(self, role: str) -> bool:
        return not self.roles or role in self.roles

    def to_dict(self) -> dict:
        return {"kind": self.kind, "limit": self.limit, "serving": self.serving, "why": self.why,
                "roles": list(self.roles)}  # fmt: skip


@dataclass(slots=True, frozen=True)
class Machine:
    """This machine as this process sees it."""

    cores: float  # usable cores: affinity, capped by the cgroup's CPU quota
    memory_bytes: int  # memory still available to it (cgroup limit less use, else MemAvailable)
    affinity: int = 0  # CPUs in the affinity mask
    quota: float | None = None  # the cgroup's cpu.max as cores, None: no quota

    @property
    def source(self) -> str:
        return f"{self.cores:g} cores" + (f" (cgroup quota of {self.affinity} CPUs)" if self.quota else "")


def machine(cgroup: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> Machine:
    """Usable cores and available memory now (cgroup v2, then v1, then the whole machine)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cpu_quota(cgroup)
    cores = min(float(cpus), quota) if quota else float(cpus)
    mem = _mem_available(meminfo)
    limit = _read_int(os.path.join(cgroup, "memory.max")) or _read_int(os.path.join(cgroup, "memory",
                                                                                     "memory.limit_in_bytes"))  # fmt: skip
    if limit and limit < 1 << 60:
        used = _read_int(os.path.join(cgroup, "memory.current")) or _read_int(
            os.path.join(cgroup, "memory", "memory.usage_in_bytes")) or 0  # fmt: skip
        mem = min(mem, max(0, limit - used)) if mem else max(0, limit - used)
    return Machine(cores=cores, memory_bytes=mem, affinity=cpus, quota=quota)


def _cpu_quota(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            q, period = f.read().split()[:2]
        return None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        pass
    q = _read_int(os.path.join(cgroup, "cpu", "cpu.cfs_quota_us"))
    p = _read_int(os.path.join(cgroup, "cpu", "cpu.cfs_period_us"))
    return q / p if q and q > 0 and p else None


def _mem_available(path: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            s = f.read().strip()
        return None if s == "max" else int(s)
    except (OSError, ValueError):
        return None


@dataclass(slots=True)
class CpuMeter:
    """Busy cores of this machine over the last ``window_s``: the CPUs of our affinity mask in /proc/stat
    (every process on them counts, ours and not: a core another program uses is not free), or the cgroup's
    own usage (cpu.stat) where a CPU quota bounds us."""

    window_s: float = 1.0  # the rate is taken against the newest sample at least this old
    stat: str = "/proc/stat"
    cgroup: str = "/sys/fs/cgroup"
    _hist: list[tuple[float, float]] = field(default_factory=list)  # (t, busy CPU seconds so far)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self, now: float | None = None, quota: bool = False) -> float | None:
        """Record the busy CPU seconds now; -> busy cores over the window (None: the first sample)."""
        now = time.monotonic() if now is None else now
        busy = (_cgroup_usage(self.cgroup) if quota else None) or _proc_busy(self.stat)
        if busy is None:
            return None
        with self._lock:
            hist = self._hist
            out = None
            if hist and now > hist[0][0]:
                old = [h for h in hist if now - h[0] >= self.window_s]
                base = old[-1] if old else hist[0]  # the newest at least window_s old, else the oldest
                del hist[: hist.index(base)]
                out = max(0.0, (busy - base[1]) / (now - base[0]))
            hist.append((now, busy))
            return out


def _proc_busy(path: str) -> float | None:
    """Busy CPU seconds (all but idle and iowait) of the CPUs in our affinity mask, from /proc/stat."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = None
    total = 0.0
    try:
        with open(path) as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *vals = line.split()
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                v = [int(x) for x in vals]
                total += (sum(v[:8]) - v[3] - v[4]) / CLK_TCK  # user..steal, less idle and iowait
    except (OSError, ValueError):
        return None
    return total


def _cgroup_usage(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.stat")) as f:
            for line in f:
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
        pass
    ns = _read_int(os.path.join(cgroup, "cpuacct", "cpuacct.usage"))
    return ns / 1e9 if ns else None


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def machine_bound(m: Machine, threads: int, serving: int, busy: float | None = None,
                  node_bytes: int = 0) -> CapacityBound:  # fmt: skip
    """The local rule (see the module doc): -> the bound on serving nodes of this machine.

    ``threads``: torch threads per node; ``serving``: nodes holding a model now; ``busy``: the machine's busy
    cores over the last window, every process's (None: not measured yet); ``node_bytes``: the largest
    serving node's resident memory (0: unknown)."""
    t = max(1, threads)
    static = max(1, math.floor(m.cores / t + 1e-9))
    per = f"{t} thread{'s' if t > 1 else ''} per node"
    if busy is None:
        limit, how = static, f"machine: {m.source}, {per} → at most {static} serving nodes"
    else:
        idle = max(0.0, m.cores - busy)
        extra = serving + math.floor(idle / t + 0.5)  # one more node per half of its threads' cores idle
        limit = max(static, min(extra, 2 * static))  # what runs at full speed is never cut by a busy moment
        how = f"machine: {m.source}, {busy:.1f} busy, {per} → at most {limit} serving nodes"
    kind = "machine"
    if node_bytes > 0:
        fits = serving + int(m.memory_bytes * 0.9 // node_bytes)  # 10% kept for the rest of the machine
        if fits < limit:
            limit, kind = max(fits, min(serving, limit)), "memory"
            how = (f"memory: {m.memory_bytes / 2**30:.1f} GiB available, {node_bytes / 2**30:.2f} GiB per node "
                   f"→ at most {limit} serving nodes")  # fmt: skip
    return CapacityBound(kind=kind, limit=limit, serving=serving, why=how)
