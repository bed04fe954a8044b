"""Configuration of the parameter store: where fragments live and how they are coded."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .errors import InvalidRequest

DEFAULT_ROOT = "./.pdserve/store"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REF_RE = re.compile(r"^(?P<name>[^@]+?)(?:@v(?P<version>\d+))?$")


def validate_name(name: str) -> str:
    """A model name is a single path segment: letters, digits, '.', '_', '-'; no '..', '/', control chars."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise InvalidRequest(
            f"invalid model name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit, no '..'"
        )
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """'name' -> (name, None) for the latest version; 'name@v3' -> (name, 3)."""
    m = REF_RE.match(ref or "")
    if not m:
        raise InvalidRequest(f"invalid model reference {ref!r}: expected NAME or NAME@vN")
    version = int(m.group("version")) if m.group("version") else None
    if version is not None and version < 1:
        raise InvalidRequest(f"invalid version in {ref!r}: versions start at v1")
    return validate_name(m.group("name")), version


@dataclass(slots=True)
class StoreConfig:
    """Where a store lives and how new imports are coded."""

    locations: list[str]  # fsspec URLs, one per failure domain; fragments of a shard go to distinct ones
    k: int = 8  # data fragments per shard (any k of k+m reconstruct it)
    m: int = 3  # parity fragments per shard (survives any m losses)
    shard_bytes: int = 128 * 2**20  # target shard size; shards break between transformer blocks
    digest: str = "blake3"  # cryptographic shard digest: blake3 | sha256
    hmac_key: bytes | None = None  # when set, manifests are signed and unsigned/tampered ones refused
    storage_options: dict[str, dict] = field(default_factory=dict)  # per URL scheme, e.g. {"s3": {...}}

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise InvalidRequest(f"invalid k={self.k}: need k >= 1")
        if not isinstance(self.m, int) or self.m < 0:
            raise InvalidRequest(f"invalid m={self.m}: need m >= 0")
        if self.k + self.m > 256:
            raise InvalidRequest(f"invalid k+m={self.k + self.m}: zfec allows at most 256 fragments")
        if not self.locations:
            raise InvalidRequest("no store locations given")
        self.locations = [normalize_url(u) for u in self.locations]
        if len(set(self.locations)) != len(self.locations):
            raise InvalidRequest("store locations must be distinct")
        if self.shard_bytes < 4096:
            raise InvalidRequest(f"invalid shard size {self.shard_bytes}: at least 4096 bytes")
        if self.digest not in ("blake3", "sha256"):
            raise InvalidRequest(f"invalid digest {self.digest!r}: blake3 or sha256")

    @property
    def n(self) -> int:
        return self.k + self.m

    def check_writable(self) -> None:
        """Imports need k+m distinct locations (reads of existing models do not)."""
        if len(self.locations) < self.n:
            raise InvalidRequest(
                f"k+m={self.n} fragments need at least {self.n} distinct locations, got {len(self.locations)}"
            )

    @classmethod
    def local_default(cls, root: str = DEFAULT_ROOT, k: int = 8, m: int = 3, **kw) -> "StoreConfig":
        """The embedded default: k+m local directories under root, each standing for a failure domain."""
        count = max(k + m, 1)
        return cls(locations=[os.path.join(root, f"loc{i:02d}") for i in range(count)], k=k, m=m, **kw)


def normalize_url(url: str) -> str:
    """Plain paths become absolute local paths; URLs keep their scheme, lose a trailing slash."""
    if not isinstance(url, str) or not url or any(ord(c) < 32 for c in url):
        raise InvalidRequest(f"invalid location {url!r}")
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return os.path.abspath(rest)
    return f"{scheme}://{rest.rstrip('/')}"
