"""Why NIXL needs a trusted fabric (compute/node/config.py NIXL_UNBOUNDED): over UCX's TCP transport (the only one
these machines have) the target does not check a READ against what it still has registered. A peer holding a
handle READs memory the target has deregistered since, and gets what is there now. So per-transfer
registration would bound nothing here, and a node refuses --kv-transport nixl unless told its peers are
trusted. If this test starts failing, UCX enforces registrations on this transport, and the gate can be
revisited."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from tests.compute.kv_transfer.peer import have_nixl

pytestmark = pytest.mark.skipif(not have_nixl(), reason="nixl-cu12 (extra 'rdma') is not installed")
N = 1 << 16


def _target(conn) -> None:
    """Register a buffer of 0xAA, send its metadata and address; on "drop": deregister it and fill it with 0xCC
    (the memory stays allocated), answer "dropped"; progress UCX meanwhile; exit on "exit" or after 60 s."""
    from compute.kv_transfer.nixl_agent import process_agent

    agent = process_agent()
    buf = torch.full((N,), 0xAA, dtype=torch.uint8)
    reg = agent.register(buf)
    conn.send((agent.metadata(), buf.data_ptr()))
    end = time.monotonic() + 60
    while time.monotonic() < end:
        agent.pump()
        if conn.poll(0.002):
            cmd = conn.recv()
            if cmd == "exit":
                return
            agent.deregister(reg)
            buf.fill_(0xCC)
            conn.send("dropped")


def _read(agent, peer: str, local: torch.Tensor, addr: int) -> int:
    local.zero_()
    x, dlists, _ = agent.read(peer, np.array([[local.data_ptr(), 4096, 0]], dtype=np.uint64),
                              np.array([[addr, 4096, 0]], dtype=np.uint64))  # fmt: skip
    try:
        end, state = time.monotonic() + 10, "PROC"
        while state == "PROC" and time.monotonic() < end:
            state = agent.state(x)
            time.sleep(0.002)
        assert state == "DONE", state
        return int(local[0])
    finally:
        agent.release(x, *dlists)


def test_a_read_lands_after_the_target_deregistered_its_memory():
    from compute.kv_transfer.nixl_agent import process_agent

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the target did not start"
        md, addr = parent.recv()
        agent = process_agent()
        peer = agent.peer(md)
        local = torch.zeros(N, dtype=torch.uint8)
        reg = agent.register(local)
        try:
            assert _read(agent, peer, local, addr) == 0xAA  # registered: the READ lands, as designed
            parent.send("drop")
            assert parent.poll(10) and parent.recv() == "dropped"
            assert _read(agent, peer, local, addr) == 0xCC  # deregistered: it still lands, on today's contents
        finally:
            agent.deregister(reg)
    finally:
        parent.send("exit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
