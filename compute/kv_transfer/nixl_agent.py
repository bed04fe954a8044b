"""This process's one NIXL agent, shared by its nixl senders and receivers.

One agent per process (``nixl_agent_config(backends=["UCX"], enable_prog_thread=
False)``, creation ~0.5 s), shared by its senders and receivers, every call under
one lock (the agent is built without NIXL's own locking). NIXL's metadata
listener (0.0.0.0:8888) is not used: metadata travels in the handle.

The agent is created on first use and never destroyed (see ``_Agent``). Every
call into it is under ``lock``; ``pump`` is the one place notifications are read
and sorted to the senders that wait for them (``take``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import uuid

import numpy as np
import torch
import xxhash

from compute.kv_transfer.base import TransportDead

log = logging.getLogger(__name__)

_AGENT: _Agent | None = None
_AGENT_LOCK = threading.Lock()


def process_agent() -> _Agent:
    """This process's NIXL agent, created on first use. ``ImportError`` without nixl-cu12,
    ``TransportDead`` when the agent or its UCX backend cannot be created."""
    global _AGENT
    with _AGENT_LOCK:
        if _AGENT is None:
            _AGENT = _Agent()
        return _AGENT


class _Agent:
    def __init__(self):
        from nixl_cu12 import (  # ImportError: the factory falls back
            nixl_agent,
            nixl_agent_config,
        )

        self.name = f"pdserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        except Exception as e:
            raise TransportDead(f"nixl: cannot create agent: {e}") from e
        if "UCX" not in self.agent.backends:
            raise TransportDead("nixl: UCX backend unavailable")
        # Never destroyed: the agent lives as long as the process, and destroying it
        # after a peer died with a notification still queued to it and a READ posted
        # to it makes UCX abort the process (arbiter.c "ucs_arbiter_group_is_empty",
        # nixl-cu12 1.5.1). The OS reclaims it at exit.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.agent.agent))
        self.lock = threading.RLock()
        self._md: bytes | None = None
        self._peers: dict[int, str] = {}  # xxh3 of loaded metadata -> agent name
        self._inbox: dict[str, list[tuple[str, str]]] = {}  # sender id -> [(op, request_id)]

    def register(self, t: torch.Tensor):
        """Register ``t``'s whole storage as one DRAM region (``t`` may be a permuted view)."""
        st = t.untyped_storage()
        with self.lock:
            self._md = None
            return self.agent.register_memory([(st.data_ptr(), st.nbytes(), 0, "")], "DRAM")

    def deregister(self, descs) -> None:
        with self.lock:
            self._md = None
            self.agent.deregister_memory(descs)

    def metadata(self) -> bytes:
        with self.lock:
            if self._md is None:
                self._md = self.agent.get_agent_metadata()
            return self._md

    def peer(self, md: bytes) -> str:
        """Load a peer's metadata (again only if it changed); returns its agent name."""
        key = xxhash.xxh3_64_intdigest(md)
        with self.lock:
            if key not in self._peers:
                name = self.agent.add_remote_agent(md)
                self._peers[key] = name.decode() if isinstance(name, bytes) else name
            return self._peers[key]

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray):
        """Post a READ of ``remote`` into ``local`` (Nx3 uint64 descriptors) -> (xfer, dlists, status)."""
        idx = np.arange(len(local), dtype=np.int32)
        made = []
        with self.lock:
            try:
                made.append(self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"))
                made.append(self.agent.prep_xfer_dlist(peer, remote, "DRAM"))
                x = self.agent.make_prepped_xfer("READ", made[0], idx, made[1], idx)
                made.insert(0, x)
                return x, tuple(made[1:]), self.agent.transfer(x)
            except Exception:
                # a failed post must be released now: a leaked request to a dead peer
                # makes UCX abort the whole process at exit
                self.release(*made)
                raise

    def state(self, x) -> str:
        """"DONE" | "PROC" | "ERR" (a disconnected peer raises in NIXL: "ERR" here)."""
        with self.lock:
            try:
                return self.agent.check_xfer_state(x)
            except Exception as e:  # noqa: BLE001 - NIXL raises on a disconnected peer
                log.debug("nixl: transfer state: %s", e)
                return "ERR"

    def release(self, *handles) -> None:
        with self.lock:
            for h in handles:
                try:
                    h.release()
                except Exception as e:  # noqa: BLE001 - cannot cancel: NIXL keeps it
                    log.warning("nixl: release of %r failed: %s", h, e)

    def notify(self, peer: str, msg: str) -> None:
        with self.lock:
            try:
                self.agent.send_notif(peer, msg.encode())
            except Exception as e:  # noqa: BLE001 - a dead peer released (or died) on its own
                log.debug("nixl: notif to %s failed: %s", peer, e)

    def subscribe(self, sender_id: str) -> None:
        with self.lock:
            self._inbox.setdefault(sender_id, [])

    def unsubscribe(self, sender_id: str) -> None:
        with self.lock:
            self._inbox.pop(sender_id, None)

    def pump(self) -> None:
        """Progress UCX (wire-up, queued notifications, READs) and sort new notifications
        ``op:sender:request`` to their senders' inboxes."""
        with self.lock:
            for msgs in self.agent.get_new_notifs().values():
                for m in msgs:
                    parts = m.decode(errors="replace").split(":", 2)
                    if len(parts) == 3 and parts[1] in self._inbox:
                        self._inbox[parts[1]].append((parts[0], parts[2]))

    def take(self, sender_id: str) -> list[tuple[str, str]]:
        """Progress UCX and return the notifications for ``sender_id``."""
        with self.lock:
            self.pump()
            mine, self._inbox[sender_id] = self._inbox.get(sender_id, []), []
            return mine
