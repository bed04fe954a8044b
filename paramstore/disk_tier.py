"""The shared disk tier of the node cache: committed files, per-key flocks and the LRU-K index.

See ``paramstore.cache`` for the on-disk layout and the locking protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .buffers import alloc
from .lruk import LruK

if TYPE_CHECKING:
    from .cache import CacheConfig

log = logging.getLogger("paramstore.cache")

KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")  # no leading '.': no '..', no staged names
_INDEX_FORMAT = "pdserve-nodecache-index/1"
_STALE_TMP_S = 3600.0  # staged files older than this belong to a dead writer


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Flock:
    """Exclusive flock on a lock file that its holder unlinks on release."""

    __slots__ = ("path", "fd", "unlink")

    def __init__(self, path: str, unlink: bool = True):
        self.path = path
        self.fd: int | None = None
        self.unlink = unlink  # False for a lock file that is never deleted (index.lock)

    def acquire(self, blocking: bool = True) -> bool:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                with contextlib.suppress(FileNotFoundError):
                    if os.path.samestat(os.stat(self.path), os.fstat(fd)):
                        self.fd, fd = fd, None
                        return True
                # else its holder unlinked it before we got it: lock the file now at that path
            except BlockingIOError:
                return False
            finally:
                if fd is not None:
                    os.close(fd)

    def release(self) -> None:
        if self.unlink:
            unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> Flock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class DiskTier:
    """The shared directory: files, per-key locks and the LRU-K index (see module docstring)."""

    __slots__ = ("root", "budget", "k", "clock", "fsync", "index_path")

    def __init__(self, cfg: CacheConfig):
        self.root, self.budget, self.k, self.clock, self.fsync = cfg.dir, cfg.disk_bytes, cfg.k, cfg.clock, cfg.fsync
        self.index_path = os.path.join(self.root, "index.json")
        os.makedirs(os.path.join(self.root, "objects"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "locks"), exist_ok=True)
        with self._index_lock():
            entries = self._scan(self._load() or {})
            self._evict(entries, ())
            self._save(entries)

    # --- files ---
    def path(self, key: str) -> str:
        return os.path.join(self.root, "objects", key[:2], key)

    def key_lock(self, key: str) -> Flock:
        return Flock(os.path.join(self.root, "locks", key + ".lock"))

    def ident(self, key: str) -> tuple[int, int] | None:
        """(inode, mtime) of the committed file of ``key``, None if absent."""
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(self.path(key))
            return (st.st_ino, st.st_mtime_ns)
        return None

    def read(self, key: str, size: int | None) -> tuple[memoryview | mmap.mmap | None, tuple[int, int] | None]:
        """(bytes, ident) of the file; (None, None) if absent; (None, ident) if of the wrong size."""
        try:
            f = open(self.path(key), "rb")
        except FileNotFoundError:
            return None, None
        with f:
            st = os.fstat(f.fileno())
            ident = (st.st_ino, st.st_mtime_ns)
            if size is not None and st.st_size != size:
                return None, ident
            buf = alloc(st.st_size)  # readinto a preallocated, 64-byte aligned buffer: no second copy
            return (buf if f.readinto(buf) == len(buf) else None), ident

    def write(self, key: str, view: memoryview) -> None:
        """Stage ``view`` next to its final name and rename it into place (caller holds the key lock)."""
        final = self.path(key)
        folder = os.path.dirname(final)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            unlink(tmp)
            raise
        if self.fsync:
            dfd = os.open(folder, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)

    def unlink_if(self, key: str, ident: tuple[int, int]) -> None:
        """Unlink the file of ``key`` if it is still the one seen as ``ident`` (caller holds the key lock)."""
        if self.ident(key) == ident:
            unlink(self.path(key))

    # --- index ---
    def touch(self, key: str, size: int) -> list[str]:
        """Record an access (a hit or a fill) of ``key``; evict others to the budget; return the evicted."""
        with self._index_lock():
            entries = self._load()
            if entries is None:
                entries = self._scan({})
            if key not in entries and self.ident(key) is None:
                return []  # evicted since we opened it: do not resurrect
            times = entries[key][1] if key in entries else []
            now = max(self.clock(), times[-1]) if times else self.clock()
            entries[key] = [size, (times + [now])[-self.k :]]
            evicted = self._evict(entries, (key,))
            self._save(entries)
            return evicted

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) as the index last recorded them (lock-free: the index is replaced atomically)."""
        entries = self._load() or {}
        return sum(e[0] for e in entries.values()), len(entries)

    def clear(self) -> int:
        """Delete every entry not being filled right now; return how many were deleted."""
        with self._index_lock():
            entries = self._scan(self._load() or {})
            dropped = [key for key in list(entries) if self._drop(key)]
            for key in dropped:
                del entries[key]
            self._save(entries)
            return len(dropped)

    def _index_lock(self) -> Flock:
        return Flock(os.path.join(self.root, "index.lock"), unlink=False)

    def _load(self) -> dict[str, list] | None:
        try:
            with open(self.index_path, "rb") as f:
                doc = json.load(f)
            if doc.get("format") != _INDEX_FORMAT:
                raise ValueError(f"unknown index format {doc.get('format')!r}")
            return {str(key): [int(s), [float(t) for t in ts][-self.k :]] for key, (s, ts) in doc["entries"].items()}
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("cache index %s unreadable (%s): rebuilding from %s/objects", self.index_path, e, self.root)
            return None

    def _save(self, entries: dict[str, list]) -> None:
        tmp = os.path.join(self.root, ".index.json.tmp")  # one writer at a time: we hold index.lock
        with open(tmp, "w") as f:
            json.dump({"format": _INDEX_FORMAT, "k": self.k, "entries": entries}, f, separators=(",", ":"))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.index_path)

    def _scan(self, entries: dict[str, list]) -> dict[str, list]:
        """Entries for exactly the files in objects/ (history kept where known); sweeps stale staged files."""
        out: dict[str, list] = {}
        now, wall = self.clock(), time.time()
        objects = os.path.join(self.root, "objects")
        for prefix in os.scandir(objects):
            if not prefix.is_dir():
                continue
            for e in os.scandir(prefix.path):
                st = e.stat()
                if e.name.startswith("."):
                    if e.name.endswith(".tmp") and wall - st.st_mtime > _STALE_TMP_S:
                        unlink(e.path)
                elif KEY_RE.fullmatch(e.name) and e.name[:2] == prefix.name:
                    old = entries.get(e.name)
                    out[e.name] = [st.st_size, old[1] if old else [min(st.st_mtime, now)]]
        return out

    def _evict(self, entries: dict[str, list], protect: Iterable[str]) -> list[str]:
        """Evict until ``entries`` fit the budget, skipping keys whose lock is held (caller holds index.lock)."""
        policy = LruK(self.k, {key: e[1] for key, e in entries.items()})
        sizes = {key: e[0] for key, e in entries.items()}
        skip, evicted = set(protect), []
        while True:
            busy = False
            for key in policy.victims(sizes, self.budget, skip):
                if self._drop(key):
                    del entries[key], sizes[key]
                    evicted.append(key)
                else:
                    skip.add(key)
                    busy = True
            if not busy:
                return evicted

    def _drop(self, key: str) -> bool:
        lock = self.key_lock(key)
        if not lock.acquire(blocking=False):
            return False
        unlink(self.path(key))
        lock.release()
        return True
