"""Node-local shard cache: a per-process memory tier over a shared disk tier, LRU-K evicted.

On-disk layout (``CacheConfig.dir``)::

    objects/$PREFIX/$KEY       a committed shard (decoded bytes); PREFIX = KEY[:2]
    objects/$PREFIX/.$KEY.$PID.$RAND.tmp
                               being written; os.replace'd onto $KEY when complete
    locks/$KEY.lock            per-key flock, held while a process fills or repairs $KEY
                               and by the evictor while it deletes $KEY
    index.json                 shared LRU-K history: {key: [size, [t_K .. t_1]]}, wall clock
    index.lock                 global flock serialising read-modify-writes of index.json

Shards are immutable and content-addressed: a committed file never changes in
place, so readers open it without a lock (eviction only unlinks the name; an open
descriptor still reads every byte) and check it with the caller's ``verify``.

Miss path of one key: take its flock; re-check ``objects/`` (another process may
have filled it meanwhile); else fetch, verify, stage, ``os.replace``, record the
access in the index and evict by size; release. Four processes missing one key at
once: one fetches, three wait on the flock and then read its file. A corrupt file
(verify fails or wrong size) is unlinked under the same lock and refetched.

Cross-process history: every disk-tier access (hit or fill) is a read-modify-write
of ``index.json`` under ``index.lock``, committed tmp + ``os.replace``, so a crash
leaves the old or the new index, never a torn one, and plain readers (``stats()``)
need no lock. The index is advisory, ``objects/`` is the truth: opening a
``NodeCache`` reconciles them (drops entries whose file is gone, adds files the
index lacks with their mtime as one access, removes stale staged files), and an
unreadable index is rebuilt the same way. Cost: one O(entries) JSON rewrite per
disk access, fine for the thousands of 1-256 MiB shards of a node.

Locks: per-key lock, then index lock. The evictor, holding the index lock, only
*tries* per-key locks (LOCK_NB) and skips keys being filled: no deadlock. A lock
file is unlinked by its holder on release; an acquirer checks after flock that the
path still names the inode it locked, else retries.

Memory tier: per process, under a thread lock. It keeps the buffer ``fetch``
returned (no copy), so ``fetch`` must return a buffer nobody reuses. Returned views
are zero-copy views of cached buffers (writable for disk reads, so
``torch.frombuffer`` takes them): callers must not write into them. An entry larger
than a tier's budget is served but not kept by it; a shard larger than the disk
budget bypasses the disk tier and its cross-process single fetch.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import metrics
from .disk_tier import KEY_RE, DiskTier
from .errors import IntegrityError, InvalidRequest
from .lruk import LruK

log = logging.getLogger("paramstore.cache")



def check_key(key: object) -> str:
    """Return ``key`` if it is a safe cache key (``[A-Za-z0-9._-]``, no leading dot), else raise."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidRequest(f"invalid cache key {key!r}: want 1-200 of [A-Za-z0-9._-], not starting with '.'")
    return key


@dataclass(slots=True)
class CacheConfig:
    """Sizes and policy of one node's shard cache."""

    dir: str  # root of the disk tier (layout in the module docstring); may be "" when disk_bytes == 0
    disk_bytes: int  # disk tier budget in bytes, shared by all processes using `dir`; 0 disables it
    memory_bytes: int  # memory tier budget in bytes, per process; 0 disables it
    k: int = 2  # K of LRU-K: evict the entry whose K-th most recent access is oldest
    clock: Callable[[], float] = time.time  # access timestamps; wall time so processes agree; fake in tests
    fsync: bool = False  # fsync staged files and their directory before a fill counts as done

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidRequest(f"CacheConfig.k must be an int >= 1, got {self.k!r}")
        for name in ("disk_bytes", "memory_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidRequest(f"CacheConfig.{name} must be an int >= 0, got {v!r}")
        if self.disk_bytes and not self.dir:
            raise InvalidRequest("CacheConfig.dir is required when disk_bytes > 0")
        if not callable(self.clock):
            raise InvalidRequest("CacheConfig.clock must be callable")


class _MemoryTier:
    """Per-process buffers under an LRU-K byte budget; callers hold ``NodeCache._lock``."""

    __slots__ = ("budget", "policy", "bufs")

    def __init__(self, budget: int, k: int):
        self.budget = budget
        self.policy = LruK(k)
        self.bufs: dict[str, memoryview] = {}

    def get(self, key: str, now: float) -> memoryview | None:
        view = self.bufs.get(key)
        if view is not None:
            self.policy.touch(key, now)
        return view

    def put(self, key: str, view: memoryview, now: float) -> int:
        """Keep ``view`` (if it fits the budget at all); return how many entries were evicted."""
        if view.nbytes > self.budget:
            return 0
        self.bufs[key] = view
        self.policy.touch(key, now)
        victims = self.policy.victims({k: v.nbytes for k, v in self.bufs.items()}, self.budget, (key,))
        for v in victims:
            del self.bufs[v]
            self.policy.remove(v)
        return len(victims)

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.bufs.values())


class NodeCache:
    """Two-tier cache of decoded shards keyed by digest. Thread- and process-safe (see module docstring)."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self._lock = threading.Lock()  # memory tier and local stats
        self._mem = _MemoryTier(config.memory_bytes, config.k) if config.memory_bytes else None
        self._disk = DiskTier(config) if config.disk_bytes else None
        self._stats = dict.fromkeys(
            ("hits_memory", "hits_disk", "misses", "fetches", "corrupt", "evictions_memory", "evictions_disk"), 0
        )

    def get(self, key: str, verify: Callable[[memoryview], bool] | None = None) -> memoryview | None:
        """The cached bytes of ``key`` or None. Disk bytes are checked with ``verify`` if given
        (they were verified before commit); a file failing it is deleted."""
        check_key(key)
        view = self._from_memory(key)
        if view is None and self._disk is not None:
            view, bad = self._from_disk(key, None, verify)
            if bad is not None:
                with self._disk.key_lock(key):
                    self._disk.unlink_if(key, bad)
        if view is None:
            self._count("misses")
            metrics.CACHE_MISSES.inc()
        return view

    def get_or_fetch(
        self, key: str, size: int, fetch: Callable[[], object], verify: Callable[[memoryview], bool]
    ) -> memoryview:
        """The bytes of ``key`` (``size`` bytes): from memory, else disk, else ``fetch()``, at most one
        fetch per key across the processes sharing the disk tier. Raises IntegrityError if fetched
        bytes fail ``verify``; exceptions of ``fetch`` propagate. Nothing is cached on failure."""
        check_key(key)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidRequest(f"size must be an int >= 0, got {size!r}")
        view = self._from_memory(key)
        if view is not None:
            return view
        disk = self._disk if self._disk is not None and size <= self._disk.budget else None
        if disk is None:
            return self._fetch(key, size, fetch, verify)
        view, bad = self._from_disk(key, size, verify)
        if view is not None:
            return view
        with disk.key_lock(key):
            if bad is not None:
                disk.unlink_if(key, bad)
            view, bad = self._from_disk(key, size, verify)  # filled by another process meanwhile?
            if view is not None:
                return view
            if bad is not None:
                disk.unlink_if(key, bad)
            view = self._fetch(key, size, fetch, verify)
            try:
                disk.write(key, view)
            except OSError as e:  # a full or broken disk costs caching, not the request
                log.warning("cache: cannot store %s in %s: %s", key, disk.root, e)
                return view
            self._evicted("disk", len(disk.touch(key, size)))
            return view

    def contains(self, key: str) -> bool:
        """Whether ``key`` is in either tier (no access is recorded)."""
        check_key(key)
        with self._lock:
            if self._mem is not None and key in self._mem.bufs:
                return True
        return self._disk is not None and self._disk.ident(key) is not None

    def stats(self) -> dict[str, int]:
        """Hits by tier, misses, fetches, corrupt files, evictions by tier (this process), bytes and entries."""
        with self._lock:
            out = dict(self._stats)
            out["bytes_memory"] = self._mem.nbytes() if self._mem else 0
            out["entries_memory"] = len(self._mem.bufs) if self._mem else 0
        out["bytes_disk"], out["entries_disk"] = self._disk.usage() if self._disk else (0, 0)
        return out

    def clear(self) -> None:
        """Empty the memory tier and delete every disk entry not being filled right now."""
        with self._lock:
            if self._mem is not None:
                self._mem = _MemoryTier(self.config.memory_bytes, self.config.k)
        if self._disk is not None:
            self._disk.clear()

    # --- internals ---
    def _from_memory(self, key: str) -> memoryview | None:
        if self._mem is None:
            return None
        with self._lock:
            view = self._mem.get(key, self.config.clock())
            if view is not None:
                self._stats["hits_memory"] += 1
        if view is not None:
            metrics.CACHE_HITS.labels(tier="memory").inc()
        return view

    def _from_disk(self, key: str, size: int | None, verify: Callable[[memoryview], bool] | None):
        """(view, None) on a good hit; (None, None) if absent; (None, ident) if the file is corrupt."""
        buf, ident = self._disk.read(key, size)
        if ident is None:
            return None, None
        if buf is None or (verify is not None and not verify(memoryview(buf))):
            log.warning("cache: corrupt entry %s in %s: deleting", key, self._disk.root)
            self._count("corrupt")
            return None, ident
        self._count("hits_disk")
        metrics.CACHE_HITS.labels(tier="disk").inc()
        self._evicted("disk", len(self._disk.touch(key, len(buf))))
        return self._keep(key, memoryview(buf)), None

    def _fetch(self, key: str, size: int, fetch: Callable[[], object], verify: Callable[[memoryview], bool]):
        self._count("misses")
        self._count("fetches")
        metrics.CACHE_MISSES.inc()
        view = memoryview(fetch()).cast("B")
        if view.nbytes != size:
            raise IntegrityError(f"fetched shard {key}: {view.nbytes} bytes, expected {size}")
        if not verify(view):
            raise IntegrityError(f"fetched shard {key}: bytes fail verification")
        return self._keep(key, view)

    def _keep(self, key: str, view: memoryview) -> memoryview:
        if self._mem is not None:
            with self._lock:
                n = self._mem.put(key, view, self.config.clock())
            self._evicted("memory", n)
        return view

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _evicted(self, tier: str, n: int) -> None:
        if n:
            self._count("evictions_" + tier, n)
            metrics.CACHE_EVICTIONS.labels(tier=tier).inc(n)
