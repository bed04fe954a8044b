"""Scrub and repair: find lost or corrupt fragments, rebuild them from survivors.

``verify`` (fast) checks that every fragment exists with the right size;
``verify(deep=True)`` reads every fragment, checks its xxh3, decodes the shard
and checks its cryptographic digest. Each shard is reported ok, degraded (which
fragments are bad, and where) or unrecoverable (fewer than k good).
``repair`` rebuilds every bad fragment from any k good ones (zfec decode, then
re-encode of the wanted indexes), checks the rebuilt bytes against the
manifest's xxh3, and rewrites them in place; it also re-copies missing manifests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from . import metrics
from .codec import ErasureCodec
from .errors import IntegrityError
from .integrity import fragment_hash, shard_digest
from .locations import Location
from .manifest import Manifest, ShardInfo


@dataclass(slots=True)
class ShardHealth:
    shard: str
    status: str  # ok | degraded | unrecoverable
    bad: list[dict] = field(default_factory=list)  # [{"fragment": i, "location": url, "reason": ...}]
    repaired: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _check_fragment(m: Manifest, loc: Location, s: ShardInfo, i: int, deep: bool) -> tuple[str | None, bytes | None]:
    """(reason it is bad or None, its bytes when read)."""
    rel = s.fragment_path(m.k, m.n, i)
    try:
        if not deep:
            size = loc.size(rel)
            if size is None:
                return "missing", None
            return (None if size == s.fragment_size else f"size {size} != {s.fragment_size}"), None
        data = loc.get(rel)
    except FileNotFoundError:
        return "missing", None
    except OSError as e:
        return f"unreadable: {e}", None
    if len(data) != s.fragment_size:
        return f"size {len(data)} != {s.fragment_size}", None
    if fragment_hash(data) != s.fragments[i].xxh3:
        return "corrupt (xxh3 mismatch)", None
    return None, data


def check_shard(m: Manifest, locs: list[Location], s: ShardInfo, deep: bool, pool: ThreadPoolExecutor):
    """-> (ShardHealth, {index: good bytes} when deep)."""
    results = list(pool.map(lambda i: _check_fragment(m, locs[s.fragments[i].location], s, i, deep), range(m.n)))
    health = ShardHealth(s.name, "ok")
    good: dict[int, bytes] = {}
    for i, (reason, data) in enumerate(results):
        if reason:
            health.bad.append({"fragment": i, "location": locs[s.fragments[i].location].url, "reason": reason})
        elif data is not None:
            good[i] = data
    n_good = m.n - len(health.bad)
    if n_good < m.k:
        health.status = "unrecoverable"
    elif health.bad:
        health.status = "degraded"
    if deep and health.status != "unrecoverable":
        codec = ErasureCodec(m.k, m.m)
        data = codec.decode(dict(sorted(good.items())[: m.k]), s.fragment_size)
        blob = b"".join(bytes(d) for d in data)[: s.size]
        if shard_digest(m.digest, blob) != s.digest:
            health.status = "unrecoverable"
            health.bad.append({"fragment": -1, "location": "", "reason": "shard digest mismatch after decode"})
    return health, good


def verify(m: Manifest, locs: list[Location], deep: bool, pool: ThreadPoolExecutor,
           progress: Callable[[], None] | None = None) -> list[ShardHealth]:  # fmt: skip
    out = []
    for s in m.shards:
        out.append(check_shard(m, locs, s, deep, pool)[0])
        if progress:
            progress()
    return out


def repair(m: Manifest, locs: list[Location], pool: ThreadPoolExecutor,
           progress: Callable[[], None] | None = None) -> list[ShardHealth]:  # fmt: skip
    codec = ErasureCodec(m.k, m.m)
    out = []
    for s in m.shards:
        health, good = check_shard(m, locs, s, True, pool)
        if health.status == "degraded":
            wanted = [b["fragment"] for b in health.bad if b["fragment"] >= 0]
            rebuilt = codec.rebuild(dict(sorted(good.items())[: m.k]), s.fragment_size, wanted)
            for i, blk in rebuilt.items():
                if fragment_hash(blk) != s.fragments[i].xxh3:
                    raise IntegrityError(f"shard {s.name}: rebuilt fragment {i} does not match the manifest")
                locs[s.fragments[i].location].put(s.fragment_path(m.k, m.n, i), blk)
                metrics.REPAIRS.inc()
            health.repaired = len(rebuilt)
        out.append(health)
        if progress:
            progress()
    return out
