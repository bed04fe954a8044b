"""Errors of the parameter store, named by what the caller should do.

- ``InvalidRequest``: the input is wrong (bad name, bad k/m, unreadable source);
  fix the input, retrying is useless. The CLI exits 2 with its message.
- ``NotFound``: the model, version or shard does not exist.
- ``ConflictRetry``: someone else published the same version first; retry.
- ``NotEnoughFragments``: fewer than k good fragments of a shard are reachable;
  the data is unrecoverable from the live locations (repair cannot help until
  locations come back). Says which shard and which locations failed.
- ``IntegrityError``: stored bytes or the manifest do not match their hashes or
  signature: the store was corrupted or tampered with.
- ``LocationUnavailable``: one storage location failed an I/O; transient, retry
  or read from another location.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the parameter store raises on purpose."""


class InvalidRequest(StoreError, ValueError):
    """The request or its input is invalid; fix it, do not retry."""


class NotFound(StoreError, LookupError):
    """A model, version or shard does not exist in the store."""


class ConflictRetry(StoreError):
    """A concurrent writer won a race (same version number); retry the operation."""


class IntegrityError(StoreError):
    """Stored data or a manifest failed its hash or signature check."""


class LocationUnavailable(StoreError, OSError):
    """A storage location failed an I/O; transient: retry or use another location."""


class NotEnoughFragments(StoreError):
    """Fewer than k good fragments of a shard are readable: the shard is unrecoverable now."""

    def __init__(self, shard: str, needed: int, good: int, failed: dict[str, str]):
        self.shard = shard
        self.needed = needed
        self.good = good
        self.failed = dict(failed)  # location url -> reason
        where = ", ".join(f"{loc} ({why})" for loc, why in sorted(self.failed.items()))
        super().__init__(
            f"shard {shard}: need {needed} good fragments, only {good} readable; failed: {where}"
        )
