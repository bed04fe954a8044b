"""A test's own network: hosts in network namespaces joined by one bridge, and the faults between them.

Layout (``I``: a number unique to the lab, from the pid and a count; every name starts with ``pd<I>``)::

    switch namespace   pd<I>sw    bridge br0; one port per host, one to the test process
    host namespaces    pd<I>h<N>  eth0 10.<211 + I // 250 % 40>.<I % 250>.<N + 10>/24 and lo
    root namespace     pd<I>r     10.<...>.<...>.1/24: the test process's own way in (its clients, scrapes)

A process runs on a host through ``ip netns exec`` (``Host.argv``) and binds its host's address. The switch and
hosts have their own netfilter tables, so a rule here touches nothing outside the lab.

Faults (each healed by ``heal``):
- ``black_hole(a, b)``: every packet between hosts ``a`` and ``b`` dropped in ``a``'s namespace (iptables DROP both
  ways): a connect hangs with no answer, an established connection stops moving; nothing is refused, as across a
  real partition (on loopback a dead peer refuses at once);
- ``black_hole_port(a, b, port)``: the same for one TCP port of ``a`` only (one service cut off, the rest flows);
- ``cut(a)``: ``a``'s switch port down: ``a`` reaches no one, no one (the test process included) reaches ``a``.

``throttle(a, mbit)`` is not a fault: ``a``'s sends limited to a rate (a token bucket, ``tc tbf``; netem is not on
these machines), so that a transfer lasts long enough to be cut mid-way; ``unthrottle(a)`` lifts it.

``close()`` removes every namespace and link (an atexit finalizer too); the processes on the hosts are their
owner's to stop first (``Services.stop_all``). Needs root, ``ip``, ``iptables`` and ``tc``: ``NetLab.why_not()`` says why a
machine cannot run it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass(slots=True)
class Host:
    name: str  # its namespace
    address: str
    port: str  # its veth end in the switch namespace

    @property
    def argv(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.name]


class NetLab:
    _made = 0  # labs made by this process (two may live at once: each its own names)

    def __init__(self) -> None:
        NetLab._made += 1
        self.id = (os.getpid() * 8 + NetLab._made) % 100000
        self.prefix = f"pd{self.id}"
        self.subnet = f"10.{211 + self.id // 250 % 40}.{self.id % 250}"
        self.switch = f"{self.prefix}sw"
        self.hosts: list[Host] = []
        self._rules: list[tuple[str, list[str]]] = []  # (namespace, iptables rule) in force
        self._closed = False
        self.close_stale()
        _ip("netns", "add", self.switch)
        atexit.register(self.close)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("-n", self.switch, "link", "set", "lo", "up")
            root = f"{self.prefix}r"
            _ip("link", "add", root, "type", "veth", "peer", "name", "up0", "netns", self.switch)
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", root)
            _ip("link", "set", root, "up")
            _ip("-n", self.switch, "link", "set", "up0", "master", "br0", "up")
        except Exception:
            self.close()
            raise

    @staticmethod
    def why_not() -> str | None:
        """Why this machine cannot run a lab (None if it can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "iptables", "tc"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        return None

    def host(self) -> Host:
        """A new host on the bridge."""
        n = len(self.hosts)
        h = Host(f"{self.prefix}h{n}", f"{self.subnet}.{n + 10}", f"p{n}")
        _ip("netns", "add", h.name)
        self.hosts.append(h)
        _ip("-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.name)
        _ip("-n", self.switch, "link", "set", h.port, "master", "br0", "up")
        _ip("-n", h.name, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _ip("-n", h.name, "link", "set", "eth0", "up")
        _ip("-n", h.name, "link", "set", "lo", "up")
        return h

    def black_hole(self, a: Host, b: Host | str) -> None:
        """Drop every packet between ``a`` and ``b`` (a host, or an address such as the test process's
        ``f"{lab.subnet}.1"``), in ``a``'s namespace."""
        other = b if isinstance(b, str) else b.address
        self._drop(a, ["INPUT", "-s", other, "-j", "DROP"], ["OUTPUT", "-d", other, "-j", "DROP"])

    def black_hole_port(self, a: Host, b: Host, port: int) -> None:
        """Drop the TCP packets between ``b`` and port ``port`` of ``a`` (both ways, in ``a``'s namespace): one
        service of ``a`` unreachable from ``b``, every other flow between them untouched."""
        self._drop(a, ["INPUT", "-s", b.address, "-p", "tcp", "--dport", str(port), "-j", "DROP"],
                   ["OUTPUT", "-d", b.address, "-p", "tcp", "--sport", str(port), "-j", "DROP"])  # fmt: skip

    def _drop(self, a: Host, *rules: list[str]) -> None:
        for rule in rules:
            subprocess.run(["ip", "netns", "exec", a.name, "iptables", "-I", *rule], check=True, capture_output=True,
                           timeout=10)  # fmt: skip
            self._rules.append((a.name, rule))

    def throttle(self, a: Host, mbit: float, burst_kb: int = 64) -> None:
        """``a``'s sends at ``mbit`` Mbit/s, after a first ``burst_kb`` KiB at the link's speed."""
        subprocess.run(["tc", "-n", a.name, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                        f"{int(mbit * 1000)}kbit", "burst", f"{burst_kb}kb", "latency", "2s"], check=True,
                       capture_output=True, timeout=10)  # fmt: skip

    def unthrottle(self, a: Host) -> None:
        subprocess.run(["tc", "-n", a.name, "qdisc", "del", "dev", "eth0", "root"], capture_output=True, timeout=10)

    def cut(self, a: Host) -> None:
        _ip("-n", self.switch, "link", "set", a.port, "down")

    def heal(self) -> None:
        """Every black hole removed and every port up."""
        while self._rules:
            ns, rule = self._rules.pop()
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-D", *rule], check=True, capture_output=True,
                           timeout=10)  # fmt: skip
        for h in self.hosts:
            _ip("-n", self.switch, "link", "set", h.port, "up")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        subprocess.run(["ip", "link", "del", f"{self.prefix}r"], capture_output=True, timeout=10)
        for name in [h.name for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)

    def close_stale(self) -> None:
        """Namespaces a killed run of this pid's lab left (a reused pid): removed before anything is made."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if name == self.switch or name.startswith(f"{self.prefix}h"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", f"{self.prefix}r"], capture_output=True, timeout=10)
