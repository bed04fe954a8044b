"""Plain-socket KV transfer: the decode side connects and pulls, the prefill side streams.

Wire protocol (one connection per transfer; frames are ``!I`` length + JSON)::

    decode -> prefill   {"op": "get", "request_id": rid, "secret": s, "first": k}
    prefill -> decode   {"ok": true, "wire_nbytes": N, "codec": c}  |  {"ok": false, "reason": r}
    prefill -> decode   N raw bytes: the units of blocks [k, n) in canonical order (layer, kv, block)
    prefill -> decode   !Q xxh3_64 of those N bytes
    decode -> prefill   {"ok": true}  |  {"ok": false, "reason": "checksum"}   (the confirmation)

Uncompressed, both ends move bytes straight between the cache and the socket
(``sendmsg`` / ``recvmsg_into`` over views of the cache, adjacent blocks merged):
no intermediate copy. ``first`` (k, default 0): the decode side already holds the offer's
first k blocks (its prefix cache): they are not sent. Compressed, the prefill side encodes into one buffer as
it streams and the decode side decodes into its blocks after the checksum.

Threads: the sender runs one accept thread (which also expires holds) and one
thread per stream; the receiver one thread per transfer, which ends on done,
abort (the socket is shut down), peer loss or timeout (socket timeouts).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time

import torch
import xxhash

from compute.kv_transfer.base import KVReceiver, KVSender, TransferState, TransportDead
from compute.kv_transfer.compression import get_codec
from compute.kv_transfer.handle import TcpHandle
from compute.kv_transfer.layout import flat_bytes

log = logging.getLogger(__name__)
MAX_STREAMS = 64  # connections served at once; more are closed at accept (that transfer fails as a broken one does)

_FRAME = struct.Struct("!I")
_DIGEST = struct.Struct("!Q")
_MAX_FRAME = 1 << 16
_IOV = 512  # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024)
_CHUNK = 4 << 20  # split runs so an abort is seen within one chunk


class _Cut(Exception):
    """The local side aborted this stream."""


def _send_frame(sock: socket.socket, obj: dict) -> None:
    b = json.dumps(obj).encode()
    sock.sendall(_FRAME.pack(len(b)) + b)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict:
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    return json.loads(_recv_exact(sock, n))


def _views(mv: memoryview, segments: list[tuple[int, int]]) -> list[memoryview]:
    out = []
    for off, n in segments:
        for o in range(off, off + n, _CHUNK):
            out.append(mv[o : min(o + _CHUNK, off + n)])
    return out


def _consume(views: list[memoryview], i: int, n: int) -> int:
    """Drop ``n`` bytes from ``views[i:]`` in place; returns the new first index."""
    while n:
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def _checksum(views: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


class TcpSender(KVSender):
    backend = "tcp"

    def __init__(self, pool, config, on_release=None):
        super().__init__(pool, config.hold_s, config.timeout_s, on_release)
        self.codec = get_codec(config.compression)
        try:
            self._sock = socket.create_server((config.host, config.port), backlog=128)
        except OSError as e:
            raise TransportDead(f"tcp: cannot listen on {config.host}:{config.port}: {e}") from e
        self._sock.settimeout(0.1)  # the accept loop also expires holds
        self.address = (config.host, self._sock.getsockname()[1])
        self._mv = memoryview(flat_bytes(pool.tensor))
        self._streams: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._serve, name="kv-tcp-accept", daemon=True)
        self._thread.start()

    def offer(self, request_id, block_ids, num_tokens):
        h = self._hold(request_id, block_ids, num_tokens)
        h.wire_nbytes = h.n * 2 * self.layout.num_layers * self.codec.wire_nbytes(self.layout)
        h.extra["secret"] = secrets.token_hex(16)
        return self._handle(TcpHandle, h, self.codec.name, address=self.address, secret=h.extra["secret"])

    def close(self):
        self._closed.set()
        self._sock.close()
        self._thread.join(2)
        for rid in self._ledger.held_ids():
            self.abort(rid)
        for th in list(self._streams):
            th.join(self.timeout_s)
        self._close_all()

    def _serve(self):
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                conn = None
            except OSError:
                break  # closed
            if conn is not None and len(self._streams) >= MAX_STREAMS:  # a flood of connections: no thread each
                conn.close()
                conn = None
            if conn is not None:
                th = threading.Thread(target=self._stream, args=(conn,), name="kv-tcp-stream", daemon=True)
                self._streams.add(th)
                th.start()
            self._expire()

    def _stream(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            req = _recv_frame(conn)
            rid = str(req.get("request_id"))
            h = self._ledger.get(rid)
            if h is None or not hmac.compare_digest(h.extra.get("secret", ""), str(req.get("secret", ""))):
                _send_frame(conn, {"ok": False, "reason": "unknown"})
                return
            first = req.get("first", 0)
            if type(first) is not int or not 0 <= first <= h.n:
                _send_frame(conn, {"ok": False, "reason": "rejected"})
                return
            h, reason = self._ledger.begin(rid)
            if h is None:
                _send_frame(conn, {"ok": False, "reason": reason})
                return
            state, reason = self._send(conn, h, first)
            self._finish(rid, state, reason)
        except Exception as e:  # noqa: BLE001 - a bad connection never takes the sender down
            log.debug("tcp stream ended: %r", e)
        finally:
            conn.close()
            self._streams.discard(threading.current_thread())

    def _send(self, conn, h, first: int = 0) -> tuple[TransferState, str]:
        end = time.monotonic() + self.timeout_s
        try:
            blocks = h.block_ids[first : h.n]
            h.wire_nbytes = len(blocks) * 2 * self.layout.num_layers * self.codec.wire_nbytes(self.layout)
            _send_frame(conn, {"ok": True, "wire_nbytes": h.wire_nbytes, "codec": self.codec.name})
            if not blocks:
                views = []
            elif self.codec.name == "none":
                views = _views(self._mv, self.pool.region.segments(blocks))
            else:
                payload = self.codec.encode(self.pool.gather(blocks))  # [L, 2, n, wire]
                views = _views(memoryview(payload.numpy()).cast("B"), [(0, payload.numel())])
            digest = _checksum(views)
            i = 0
            while i < len(views):
                if h.cut:
                    raise _Cut
                if time.monotonic() > end:
                    raise TimeoutError
                i = _consume(views, i, self._send_segment(conn, views[i : i + _IOV]))
            conn.sendall(_DIGEST.pack(digest))
            ack = _recv_frame(conn)
        except _Cut:
            return TransferState.FAILED, h.ending or "aborted"
        except TimeoutError:
            return TransferState.FAILED, "timeout"
        except (OSError, ValueError):
            return TransferState.FAILED, "peer_lost"
        if ack.get("ok"):
            return TransferState.DONE, ""
        return TransferState.FAILED, str(ack.get("reason", "rejected"))

    def _send_segment(self, conn: socket.socket, views: list[memoryview]) -> int:
        """Send some of ``views``; returns bytes sent (a seam for tests of slow links)."""
        return conn.sendmsg(views)


class TcpReceiver(KVReceiver):
    backend = "tcp"

    def __init__(self, pool, config):
        super().__init__(pool, config.timeout_s)
        self._mv = memoryview(flat_bytes(pool.tensor))
        self._write = threading.Lock()  # a decode into the cache vs abort

    def start(self, handle, dst_block_ids, first_block=0):
        dst = self._check_handle(handle, dst_block_ids, first_block)
        t = self._new(handle, dst, first_block)
        if not t.terminal:
            t.extra.update(handle=handle, cut=threading.Event(), sock=None)
            th = threading.Thread(target=self._fetch, args=(t,), name="kv-tcp-fetch", daemon=True)
            t.extra["thread"] = th
            th.start()
        return t.id

    def abort(self, transfer_id):
        t = self._ledger.get(transfer_id)
        if t is None or t.terminal:
            return
        with self._write:
            t.extra["cut"].set()
            self._finish(t, TransferState.FAILED, "aborted")
        sock = t.extra.get("sock")
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        t.extra["thread"].join(self.timeout_s)  # after this, nothing writes into t.dst

    def _fetch(self, t) -> None:
        h, cut = t.extra["handle"], t.extra["cut"]
        reason, sock = "peer_lost", None
        try:
            sock = socket.create_connection(h.address, timeout=max(t.remaining(), 1e-3))
            t.extra["sock"] = sock
            if cut.is_set():
                raise _Cut
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_frame(sock, {"op": "get", "request_id": h.request_id, "secret": h.secret, "first": t.first})
            resp = _recv_frame(sock)
            if not resp.get("ok"):
                reason = str(resp.get("reason", "rejected"))
                raise ConnectionError(reason)
            if resp.get("wire_nbytes") != t.wire_nbytes or resp.get("codec") != h.codec:
                reason = "rejected"
                raise ConnectionError("stream does not match the handle")
            self._ledger.moving(t)
            codec = get_codec(h.codec)
            if not t.dst:
                payload, views = None, []
            elif codec.name == "none":
                payload, views = None, _views(self._mv, self.pool.region.segments(t.dst))
            else:
                payload = torch.empty((self.layout.num_layers, 2, len(t.dst), codec.wire_nbytes(self.layout)),
                                      dtype=torch.uint8)  # fmt: skip
                views = _views(memoryview(payload.numpy()).cast("B"), [(0, payload.numel())])
            check = list(views)
            i = 0
            while i < len(views):
                if cut.is_set():
                    raise _Cut
                if t.overdue():
                    raise TimeoutError
                sock.settimeout(max(t.remaining(), 1e-3))
                n = sock.recvmsg_into(views[i : i + _IOV])[0]
                if n == 0:
                    raise ConnectionError("peer closed mid-stream")
                i = _consume(views, i, n)
            (theirs,) = _DIGEST.unpack(_recv_exact(sock, _DIGEST.size))
            if _checksum(check) != theirs:
                _send_frame(sock, {"ok": False, "reason": "checksum"})
                reason = "checksum"
                raise ConnectionError("checksum mismatch")
            with self._write:
                if cut.is_set():
                    raise _Cut
                if payload is not None:
                    self.pool.scatter(t.dst, codec.decode(payload, self.layout))
                self._finish(t, TransferState.DONE)
            try:
                _send_frame(sock, {"ok": True})
            except OSError:
                pass  # the KV is here; the sender releases on its own
        except _Cut:
            pass  # abort() already finished the transfer
        except TimeoutError:
            self._finish(t, TransferState.FAILED, "timeout")
        except (OSError, ValueError) as e:
            log.debug("tcp fetch of %s failed: %r", t.request_id, e)
            self._finish(t, TransferState.FAILED, "aborted" if cut.is_set() else reason)
        finally:
            if sock is not None:
                sock.close()


