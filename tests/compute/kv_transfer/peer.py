"""A prefill-side child process for the transfer tests, driven over a Pipe.

The child fills a cache with seeded random KV, builds senders with
``make_transfer`` and answers commands: offer, wait (for an offer's terminal
state), held (wait until nothing is held), exit. It exits by itself when the
parent stops talking (bounded), so no test can leave it behind.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import time

import torch

NUM_BLOCKS = 12


def have_nixl() -> bool:
    return importlib.util.find_spec("nixl_cu12") is not None


def random_cache(layout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape(num_blocks), generator=g).to(layout.dtype)


def _serve(conn, layout_dict, senders, seed, slow_s):
    from compute.kv_transfer import KVLayout, KVPool, make_transfer, tcp

    layout = KVLayout.from_dict(layout_dict)
    pool = KVPool(layout, random_cache(layout, NUM_BLOCKS, seed))
    if slow_s:  # a slow link: one buffer per send, a pause before each
        def slow(self, sock, views):
            time.sleep(slow_s)
            return sock.send(views[0])

        tcp.TcpSender._send_segment = slow
    made = {name: make_transfer(cfg.pop("backend"), "prefill", layout, pool, **cfg) for name, cfg in senders.items()}
    conn.send(("ready", os.getpid()))
    try:
        while conn.poll(60):
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            name, *args = args
            s = made[name]
            try:
                if cmd == "offer":
                    conn.send(s.offer(*args))
                elif cmd == "wait":  # (request_id, timeout) -> (state, reason)
                    rid, timeout = args
                    end = time.monotonic() + timeout
                    while not s.poll(rid).terminal and time.monotonic() < end:
                        time.sleep(0.002)
                    f = s.failure(rid)
                    conn.send((s.poll(rid).value, f.reason if f else ""))
                elif cmd == "held":  # (timeout) -> held count once 0 or at timeout
                    (timeout,) = args
                    end = time.monotonic() + timeout
                    while s.held() and time.monotonic() < end:
                        time.sleep(0.005)
                    conn.send(s.held())
            except Exception as e:  # noqa: BLE001 - report to the parent, keep serving
                conn.send(e)
    finally:
        for s in made.values():
            s.close()


class Peer:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @classmethod
    def spawn(cls, layout, senders: dict, seed: int = 1, slow_s: float = 0.0, timeout: float = 60) -> Peer:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(b, layout.to_dict(), senders, seed, slow_s), daemon=True)
        proc.start()
        p = cls(proc, a)
        assert p._recv(timeout)[0] == "ready"
        return p

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, *cmd, timeout: float = 15):
        self.conn.send(cmd)
        return self._recv(timeout)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
