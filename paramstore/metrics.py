"""Prometheus metrics of the parameter store (process-global, default registry).

Targets from the design: shard load P99 < 200 ms; warm-node cache hit ratio > 95%.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

SHARD_LOAD_SECONDS = Histogram(
    "paramstore_shard_load_seconds",
    "Time to fetch, verify and decode one shard (cache hits included)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CACHE_HITS = Counter("paramstore_cache_hits_total", "Node-local cache hits", ["tier"])  # tier: memory|disk
for _tier in ("memory", "disk"):  # at zero from the start: a cache that never hits still has a hit ratio (alerted on)
    CACHE_HITS.labels(tier=_tier)
CACHE_MISSES = Counter("paramstore_cache_misses_total", "Node-local cache misses")
CACHE_EVICTIONS = Counter("paramstore_cache_evictions_total", "Node-local cache evictions", ["tier"])
BYTES_READ = Counter("paramstore_bytes_read_total", "Fragment bytes read per location", ["location"])
BYTES_WRITTEN = Counter("paramstore_bytes_written_total", "Fragment bytes written per location", ["location"])
FRAGMENT_ERRORS = Counter(
    "paramstore_fragment_errors_total", "Fragments missing, corrupt or failing to read", ["location", "kind"]
)
DEGRADED_READS = Counter("paramstore_degraded_reads_total", "Shard reads that needed parity fragments")
REPAIRS = Counter("paramstore_repaired_fragments_total", "Fragments rebuilt by repair")
