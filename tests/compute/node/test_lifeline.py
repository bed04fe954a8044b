"""compute/node/lifeline.py with real processes: a parent spawns a child the way the local actuator
spawns a node, the parent is SIGKILLed, and the child must end. Each mechanism alone:

- the pipe: no parent-death signal asked for; the child even ignores SIGTERM, so only the
  os._exit after the grace can end it;
- the parent-death signal (Linux): the parent first forks a holder that keeps the pipe's write end
  open, so only the kernel's signal can end the child;
- without the environment variables (a node started by hand) hold() does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.procs import alive, kill_left, started, wait_gone

CHILD = textwrap.dedent("""
    import signal, sys, time
    from compute.node.lifeline import hold
    if sys.argv[1] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("tied" if hold(grace_s=float(sys.argv[2])) else "untied", flush=True)
    time.sleep(120)
""")

PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from compute.node.lifeline import spawn_kwargs
    mode, grace, child = sys.argv[1], sys.argv[2], sys.argv[3]
    kw = spawn_kwargs(dict(os.environ), pdeathsig=mode == "pdeathsig")
    p = subprocess.Popen([sys.executable, "-c", child, "ignore-term" if mode == "pipe" else "plain", grace], **kw)
    holder = 0
    if mode == "pdeathsig":  # a forked copy keeps the pipe's write end open: only the signal can work
        holder = os.fork()
        if holder == 0:
            time.sleep(60)
            os._exit(0)
    print(p.pid, holder, flush=True)
    time.sleep(120)
""")


def _run_parent(mode: str, grace: float):
    """(parent, child pid, holder pid or 0, {pid: start time} of each of them to kill after the test)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode, str(grace), CHILD], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd())  # fmt: skip
    child, holder = (int(x) for x in parent.stdout.readline().split())
    assert parent.stdout.readline().strip() == "tied"  # the child's hold() is done
    ours = {p: started(p) for p in (parent.pid, child, holder) if p}
    return parent, child, holder, ours


@pytest.mark.timeout(60)
def test_the_pipe_ends_a_child_whose_parent_is_sigkilled_even_if_it_ignores_sigterm():
    grace = 1.0
    parent, child, _, ours = _run_parent("pipe", grace)
    try:
        assert alive({child: ours[child]})
        parent.kill()
        parent.wait(10)
        took = wait_gone({child: ours[child]}, grace + 10)  # else the child outlived its parent
        assert took >= grace - 0.1  # SIGTERM was ignored: it was the os._exit after the grace
    finally:
        kill_left(ours)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.timeout(60)
def test_the_parent_death_signal_ends_the_child_while_the_pipe_is_still_held_open():
    parent, child, holder, ours = _run_parent("pdeathsig", 30.0)
    try:
        assert alive({child: ours[child], holder: ours[holder]}) == [child, holder]
        parent.kill()
        parent.wait(10)
        wait_gone({child: ours[child]}, 10)  # else the parent-death signal did not end the child
        assert alive({holder: ours[holder]})  # the pipe was still open: the kernel's signal did it
    finally:
        kill_left(ours)


def test_without_the_environment_nothing_is_tied():
    out = subprocess.run([sys.executable, "-c", CHILD.replace("time.sleep(120)", ""), "plain", "1"],
                         capture_output=True, text=True, timeout=30,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")})  # fmt: skip
    assert out.stdout.strip() == "untied", out.stderr
