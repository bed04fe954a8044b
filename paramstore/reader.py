"""Read API for compute nodes: open a model, read shards in layer order, get tensors.

Lifecycle of one shard read (``ModelReader.read``):
 1. node cache (memory, then disk) by shard digest — a hit skips the store;
 2. fetch the k data fragments in parallel, each ``readinto`` its place in one buffer
    of k * L bytes (zero-copy on local locations), and check each one's xxh3;
 3. a data fragment that is missing, corrupt, failing or slower than ``hedge_s`` is
    replaced by parity fragments (fetched only then); with fewer than k good ones:
    ``NotEnoughFragments`` naming the shard and the failed locations. A read slower than ``hedge_s``
    gives its slot back (``io_threads`` reads run at once, stalled ones aside: a location that hangs
    cannot hold every slot while its calls wait out their timeouts) and its location is asked last
    for a while (``health.mark_failed``);
 4. zfec rebuilds missing data fragments into their place (a degraded read is counted)
    and the shard's cryptographic digest is checked (``verify_digest``: after a rebuild,
    always, or never);
 5. the safetensors header is parsed and tensors are ``torch.frombuffer`` views of the buffer.
``iter_shards`` keeps ``prefetch`` shards in flight ahead of the consumer.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from . import metrics
from .buffers import alloc
from .codec import ErasureCodec
from .errors import IntegrityError, InvalidRequest, NotEnoughFragments
from .health import mark_failed, suspect
from .integrity import fragment_hash, shard_digest
from .locations import LocalLocation, Location
from .manifest import Manifest, ShardInfo
from .shards import unpack, unpack_files


@dataclass(slots=True)
class ReaderConfig:
    """How a node reads shards."""

    prefetch: int = 2  # shards in flight ahead of the consumer
    io_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 2))  # parallel fragment reads
    # (one per core: more threads only contend for memory bandwidth on a small box — 2 beat 8 here)
    hedge_s: float = 2.0  # a data fragment slower than this is raced by a parity fragment
    verify_digest: str = "degraded"  # degraded | always | never: cryptographic check of the shard

    def __post_init__(self) -> None:
        if self.prefetch < 0 or self.io_threads < 1 or self.hedge_s <= 0:
            raise InvalidRequest("invalid reader config: prefetch >= 0, io_threads >= 1, hedge_s > 0")
        if self.verify_digest not in ("degraded", "always", "never"):
            raise InvalidRequest(f"invalid verify_digest {self.verify_digest!r}")


@dataclass(slots=True)
class ShardRead:
    """Outcome of one shard read."""

    shard: ShardInfo
    buffer: memoryview  # the shard bytes (tensors view it)
    seconds: float
    degraded: int = 0  # data fragments rebuilt from parity
    cache_hit: bool = False
    failed: dict[str, str] = field(default_factory=dict)  # location -> reason

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return unpack(self.buffer)


class _Slots:
    """At most ``n`` fragment reads running at once; ``free`` gives a stalled read's slot back before it ends (its
    thread waits out its own timeout aside), once per read."""

    def __init__(self, n: int):
        self._sem, self._lock, self._held = threading.Semaphore(n), threading.Lock(), set()

    def take(self, token: object) -> None:
        self._sem.acquire()
        with self._lock:
            self._held.add(token)

    def free(self, token: object) -> bool:
        """True if ``token`` held a slot (and gives it back now)."""
        with self._lock:
            if token not in self._held:
                return False
            self._held.remove(token)
        self._sem.release()
        return True


class _Late(Exception):
    """A fragment read that ended after its shard was finished without it: dropped, its bytes written nowhere."""


@dataclass(slots=True)
class _Fetch:
    """One shard's fetch, as its fragment reads see it: once ``over``, a late read (one stalled past the hedge, on a
    location that hung) writes nothing into the shard's buffer, which the model's tensors may view by then."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    over: bool = False


STALLED_THREADS = 4  # threads per io slot: room for reads stalled on a hanging location beside the running ones


class ModelReader:
    """Reads one manifest's shards from its locations (optionally through a node cache)."""

    def __init__(self, manifest: Manifest, locations: list[Location], config: ReaderConfig | None = None, cache=None):
        self.manifest = manifest
        self.locations = locations  # aligned with manifest.locations
        self.config = config or ReaderConfig()
        self.cache = cache
        self.codec = ErasureCodec(manifest.k, manifest.m)
        self._io = ThreadPoolExecutor(self.config.io_threads * STALLED_THREADS, thread_name_prefix="paramstore-io")
        self._slots = _Slots(self.config.io_threads)
        self._ahead = ThreadPoolExecutor(max(1, self.config.prefetch), thread_name_prefix="paramstore-prefetch")

    def close(self) -> None:
        """Stops reading; reads stalled on a hanging location are not waited for (they end at their own timeouts; a
        remote one writes nothing then: ``_Fetch``; a local one reads straight into its place, as a zero-copy read
        must, and a local disk is not expected to hang)."""
        self._ahead.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- reading -------------------------------------------------------------------------
    def read(self, shard: ShardInfo, out: bytearray | None = None) -> ShardRead:
        """One shard's bytes, verified. `out` (>= k * fragment_size bytes) is reused if given."""
        t0 = time.perf_counter()
        if self.cache is not None:
            state = {}

            def fetch():  # the cache keeps this buffer: never a reused `out`
                r = self._fetch(shard, None)
                state["read"] = r
                return r.buffer

            buf = self.cache.get_or_fetch(shard.digest, shard.size, fetch, lambda b: self._digest_ok(shard, b))
            r = state.get("read") or ShardRead(shard, memoryview(buf), 0.0, cache_hit=True)
        else:
            r = self._fetch(shard, out)
        r.seconds = time.perf_counter() - t0
        metrics.SHARD_LOAD_SECONDS.observe(r.seconds)
        return r

    def _digest_ok(self, shard: ShardInfo, buf) -> bool:
        return len(buf) == shard.size and shard_digest(self.manifest.digest, buf) == shard.digest

    def _fetch(self, shard: ShardInfo, out: bytearray | None) -> ShardRead:
        k, frag = self.manifest.k, shard.fragment_size
        need = k * frag
        buf = out if out is not None and len(out) >= need else alloc(need)
        view = memoryview(buf)[:need]
        good: dict[int, memoryview] = {}
        failed: dict[str, str] = {}
        pending: dict[Future, tuple[int, object]] = {}  # a read in flight -> (its fragment, its slot's token)
        # k fragments first: data on locations that answer (they land straight in their place), then parity there,
        # then those on locations that failed lately (a partition: their calls hang until their timeouts)
        order = sorted(range(self.manifest.n), key=lambda i: (suspect(self._location(shard, i)), i >= k))
        parity = deque(order)
        state = _Fetch()
        try:
            self._gather(shard, state, parity, pending, view, good, failed)
        finally:
            with state.lock:
                state.over = True
        for fut in pending:
            fut.cancel()
        missing = [i for i in range(k) if i not in good]
        if missing:
            chosen = dict(sorted(good.items())[:k])
            data = self.codec.decode(chosen, frag)
            for i in missing:
                view[i * frag : (i + 1) * frag] = data[i]
            metrics.DEGRADED_READS.inc()
        result = view[: shard.size]
        policy = self.config.verify_digest
        if (policy == "always" or (policy == "degraded" and missing)) and not self._digest_ok(shard, result):
            raise IntegrityError(f"shard {shard.name}: digest mismatch after decode")
        return ShardRead(shard, result, 0.0, degraded=len(missing), failed=failed)

    def _gather(self, shard: ShardInfo, state: _Fetch, parity: deque, pending: dict, view: memoryview, good: dict,
                failed: dict) -> None:  # fmt: skip
        """k good fragments into ``good`` (index -> bytes), racing slow ones, replacing failed ones."""
        k = self.manifest.k
        for _ in range(k):
            self._submit_next(shard, state, parity, pending, view)
        deadline = time.monotonic() + self.config.hedge_s
        while len(good) < k:
            if not pending and not parity:
                raise NotEnoughFragments(shard.name, k, len(good), failed)
            timeout = max(0.0, deadline - time.monotonic())
            done, _ = wait(list(pending), timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:  # slow fragments: race them with the next in line (parity, or those of failing locations)
                for idx, token in pending.values():  # stalled: their slots to the racers, their locations asked
                    if self._slots.free(token):  # last (a read still queued for a slot stalled nothing)
                        mark_failed(self._location(shard, idx))
                for _ in range(min(len(parity), k - len(good))):
                    self._submit_next(shard, state, parity, pending, view)
                deadline = time.monotonic() + self.config.hedge_s
                continue
            for fut in done:
                idx, _ = pending.pop(fut)
                err = fut.exception()
                if err is None:
                    good[idx] = fut.result()
                else:
                    loc = self._location(shard, idx)
                    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError):
                        mark_failed(loc)
                    failed[loc.url] = str(err)
                    metrics.FRAGMENT_ERRORS.labels(loc.url, type(err).__name__).inc()
                    if parity:
                        self._submit_next(shard, state, parity, pending, view)

    def _location(self, shard: ShardInfo, index: int) -> Location:
        return self.locations[shard.fragments[index].location]

    def _submit_next(self, shard: ShardInfo, state: _Fetch, parity: deque, pending: dict, view: memoryview) -> None:
        """The next fragment in line: a data fragment straight into its place in ``view``, parity into its own."""
        i, k, frag, token = parity.popleft(), self.manifest.k, shard.fragment_size, object()
        into = view[i * frag : (i + 1) * frag] if i < k else None
        pending[self._io.submit(self._get_fragment, shard, state, i, into, token)] = (i, token)

    def _get_fragment(self, shard: ShardInfo, state: _Fetch, index: int, into: memoryview | None,
                      token: object) -> memoryview:  # fmt: skip
        self._slots.take(token)
        try:
            return self._read_fragment(shard, state, index, into)
        finally:
            self._slots.free(token)

    def _read_fragment(self, shard: ShardInfo, state: _Fetch, index: int, into: memoryview | None) -> memoryview:
        """Fragment ``index``, checked; a data fragment lands in its place ``into``: a local one read straight there,
        a remote one (which may stall) copied there only while its shard's fetch is not over."""
        ref = shard.fragments[index]
        loc = self.locations[ref.location]
        rel = shard.fragment_path(self.manifest.k, self.manifest.n, index)
        direct = into is None or isinstance(loc, LocalLocation)
        try:
            if direct:
                target = into if into is not None else memoryview(bytearray(shard.fragment_size))
                n = loc.readinto(rel, target)
            else:
                target = memoryview(loc.get(rel))  # the object's own bytes: copied into place below, if in time
                n = len(target)
        except FileNotFoundError:
            raise FileNotFoundError(f"fragment {index} missing") from None
        if n != shard.fragment_size:
            raise IntegrityError(f"fragment {index} has {n} bytes, expected {shard.fragment_size}")
        if fragment_hash(target) != ref.xxh3:
            raise IntegrityError(f"fragment {index} fails its xxh3 check")
        metrics.BYTES_READ.labels(loc.url).inc(n)
        if direct:
            return target
        with state.lock:
            if state.over:
                raise _Late(f"fragment {index} came after its shard was read")
            into[:] = target
        return into

    # --- iteration ----------------------------------------------------------------------
    def iter_shards(self, shards: list[ShardInfo] | None = None) -> Iterator[ShardRead]:
        """Weight shards in load order, `prefetch` of them in flight ahead of the consumer."""
        todo = list(shards if shards is not None else self.manifest.weight_shards())
        inflight: deque[Future] = deque()
        nxt = 0
        try:
            while nxt < len(todo) or inflight:
                while nxt < len(todo) and len(inflight) < max(1, self.config.prefetch):
                    inflight.append(self._ahead.submit(self.read, todo[nxt]))
                    nxt += 1
                yield inflight.popleft().result()
        finally:
            for f in inflight:
                f.cancel()

    def bundle(self) -> dict[str, bytes]:
        """Tokenizer, chat template and other files imported with the model."""
        s = self.manifest.bundle_shard()
        return unpack_files(self.read(s).buffer) if s else {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model as stored (int8 weights with their scales)."""
        out: dict[str, torch.Tensor] = {}
        for r in self.iter_shards():
            out.update(r.tensors()[0])
        return out
