"""Prometheus metrics of KV transfer, one place: which transport carried the bytes.

``direction`` is ``sent`` (prefill side, counted when the receiver confirms) or
``received`` (decode side). Bytes are wire bytes (after compression); what
compression saved is counted separately. A fallback from nixl to tcp is both
logged and counted, never silent.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

BYTES = Counter("pdserve_kv_transfer_bytes", "KV bytes moved by a transfer backend (wire bytes)",
                ["backend", "direction"])  # fmt: skip
SECONDS = Histogram("pdserve_kv_transfer_seconds", "Receiver start-to-done time of one KV transfer", ["backend"],
                    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))  # fmt: skip
FAILURES = Counter("pdserve_kv_transfer_failures", "Failed KV transfers (either side)", ["backend", "reason"])
FALLBACKS = Counter("pdserve_kv_transfer_fallbacks", "Transfer backend unavailable, another one used instead",
                    ["from_backend", "to_backend"])  # fmt: skip
SAVED = Counter("pdserve_kv_transfer_saved_bytes", "KV bytes not sent thanks to wire compression (received side)",
                ["backend"])  # fmt: skip
QUARANTINE = Counter("pdserve_kv_transfer_quarantine", "Ended receives whose transport might still write: "
                     "held aside, freed once seen stopped, or leaked (never seen to stop)", ["backend", "event"])  # fmt: skip
