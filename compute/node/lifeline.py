"""A node's tie to the process that started it: the node ends when its parent does, even on SIGKILL.

Parent side (``spawn_kwargs``, used by the local actuator and the launcher): one pipe per parent
process, made on first use; every child inherits its read end (``pass_fds``) and finds the fd and
the parent's pid in its environment (``PDSERVE_LIFELINE_FD``, ``PDSERVE_PARENT_PID``). The parent
keeps the write end open for its whole life and never writes to it; the write end is
close-on-exec, so no other exec'd child holds it. However the parent ends, the kernel closes it.

Child side (``hold``, first thing in ``pdserve node``, and in ``pdserve up`` for the launcher's sake):
 1. Linux, when asked (``PDSERVE_PDEATHSIG=1``): ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` — the kernel
    sends SIGTERM when the *thread* that forked the node exits, so a parent asks for it only when
    it spawns from a thread that lives as long as it does; then ``getppid()`` is compared with
    ``PDSERVE_PARENT_PID``: a parent that died before the prctl is caught too;
 2. everywhere: a daemon thread blocks reading the pipe; end-of-file means the parent is gone ->
    SIGTERM to itself (the node's graceful stop) and ``os._exit`` after ``grace_s`` if that did
    not end it.
Without the variables (a node started by hand, by systemd or by Kubernetes) nothing happens. A
parent that ``os.fork``s without exec hands the write end to that child too: the node then lives
until both are gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("pdserve.node")
FD_ENV, PID_ENV, DEATHSIG_ENV = "PDSERVE_LIFELINE_FD", "PDSERVE_PARENT_PID", "PDSERVE_PDEATHSIG"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_pipe: tuple[int, int] | None = None
_pipe_lock = threading.Lock()


# --- parent side ---------------------------------------------------------------------
def spawn_kwargs(env: dict, pdeathsig: bool) -> dict:
    """Popen keyword arguments that tie the child to this process: ``env`` (a copy, with the
    lifeline variables) and ``pass_fds``. ``pdeathsig``: the caller spawns from a thread that
    lives as long as this process's interest in the child (the main thread, a spawner thread)."""
    global _pipe
    with _pipe_lock:
        if _pipe is None:
            _pipe = os.pipe()  # both ends close-on-exec; pass_fds opens the read end to the child
    env = dict(env, **{FD_ENV: str(_pipe[0]), PID_ENV: str(os.getpid())})
    if pdeathsig:
        env[DEATHSIG_ENV] = "1"
    else:
        env.pop(DEATHSIG_ENV, None)
    return {"env": env, "pass_fds": (_pipe[0],)}


# --- child side ----------------------------------------------------------------------
def hold(grace_s: float = 10.0) -> bool:
    """Tie this process to its parent as the environment says; True when a tie was made."""
    fd_s, pid_s = os.environ.pop(FD_ENV, ""), os.environ.pop(PID_ENV, "")
    deathsig = os.environ.pop(DEATHSIG_ENV, "") == "1"
    if not fd_s or not pid_s:
        return False
    fd, parent = int(fd_s), int(pid_s)
    if deathsig:
        _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before we got here (we were re-parented)
        print(f"pdserve: the process that started this one (pid {parent}) is gone: exiting", file=sys.stderr,
              flush=True)  # fmt: skip
        os._exit(1)
    threading.Thread(target=_watch, args=(fd, grace_s), name="lifeline", daemon=True).start()
    return True


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        return True
    except (OSError, AttributeError) as e:  # no libc prctl: the pipe still ties us
        log.warning("parent-death signal unavailable (%s): relying on the lifeline pipe", e)
        return False


def _watch(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 1):  # the parent never writes: only EOF (or an error) returns
            pass
    except OSError:
        pass
    print("pdserve: the process that started this one is gone: stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"pdserve: still running {grace_s:g} s after its parent ended: exiting now", file=sys.stderr, flush=True)
    os._exit(1)
