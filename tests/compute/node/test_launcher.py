"""compute/node/launcher.py's ports: the OS may pick a port it picked a moment ago, before the process given it
binds it; two services started in a row once got one port (a gateway that could not bind looked ready because
the decode node on its port answered). ``free_port`` hands a port out once per ``RESERVE_S``."""

from __future__ import annotations

import socket

from compute.node import launcher


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch):
    picks = iter([47001, 47001, 47001, 47002, 47001, 47003])

    class OsPicks(socket.socket):  # the OS's pick, replayed: the same port three times in a row
        def getsockname(self):
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(launcher.socket, "socket", OsPicks)
    monkeypatch.setattr(launcher, "_GIVEN", {})
    assert [launcher.free_port() for _ in range(3)] == [47001, 47002, 47003]


def test_ports_from_the_os_are_distinct_and_bindable():
    ports = [launcher.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing of ours bound it
