"""Machine-class artefacts in the store: one sealed index per object, and beside it, for some kinds, a package.

Kernel plans (``plans.py``) and compiled step graphs (``graphs.py``) are objects of one shape: built by one node of
a class of machine, read by every other node of that class instead of building. This module writes, reads and
verifies them for both; a kind names its folder, its format and its own checks.

Layout under every location root (replicated, like manifests; a reader takes the first location whose index is
valid *and*, for a kind with packages, whose package matches it)::

    <root>/<prefix>/<id>.json     the index: {WRAP: BODY, "integrity": SEAL}
    <root>/<prefix>/<id><ext>     the package's bytes (a kind with packages only: step graphs, ``.pt2``)

``id`` is 16 lowercase hex digits. BODY is ``{"format", "revision", "published", "by"}`` with the kind's own
fields and, for a kind with packages, the package's ``"size"`` and ``"sha256"``; SEAL is ``integrity.seal(BODY,
key, publisher)`` (sha256, an HMAC where the store has a key, the publisher's signature where it signs).

Lifecycle of one object:
 1. ``_write``: refused where the store wants the publisher's signature and this process cannot sign; the next
    revision (the first valid index's + 1; a publish overwrites, there is no claim race: two nodes of one class
    build the same); on each location the package first and the index after it (a reader never meets an index
    whose package is not there yet); ``LocationUnavailable`` if no location took it;
 2. ``_read``: the first copy whose index is sealed, of the kind's format, accepted by the kind's ``check`` (and
    the caller's ``accept``), and whose package has the index's size (read only then) and sha256; ``NotFound``
    if there is none, ``IntegrityError`` if no copy is valid. A reader that meets a re-publish between a package
    and its index sees a package that does not match its (older) index: that copy is refused, the next taken;
 3. ``_ids`` lists the ids with an index or a package anywhere; ``delete`` removes the index first, then the
    package (never an index without its package).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from .catalog import first_valid, listed, try_put
from .errors import IntegrityError, InvalidRequest, LocationUnavailable, NotFound
from .integrity import check_seal, seal
from .locations import Location
from .publisher import Publisher

ID = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
Accept = Callable[[dict], None]  # a caller's own refusal of a sealed body: raises IntegrityError


class SealedObjects(ABC):
    """The objects of one kind in one store (module doc): ``get``/``publish``/``list`` are the kind's, ``delete``
    and the verbs below shared."""

    prefix: str  # the folder under every location root ("plans", "graphs")
    wrap: str  # the body's name in its index ("plan", "graph")
    format: str  # BODY["format"] of this kind
    label: str  # how a message names one ("kernel plan", "step graph")
    plural: str  # what a publisher signs, in a message ("plans", "packages")
    package: str = ""  # the ending of the package beside the index (".pt2"); "": the index is the whole object
    max_package_bytes: int = 0  # a kind with packages: refused past this many bytes

    def __init__(self, locations: list[Location], key: bytes | None, pool, publisher: Publisher | None = None):
        self.locations, self.key, self.pool = locations, key, pool
        self.publisher = publisher or Publisher()

    @abstractmethod
    def object_id(self, name) -> str:
        """The id ``name`` stands for; ``InvalidRequest`` if it names none."""

    @abstractmethod
    def check(self, body: dict, oid: str) -> None:
        """Raise ``IntegrityError`` unless the sealed ``body``, of this kind's format, is well formed for ``oid``."""

    @property
    def can_publish(self) -> bool:
        """False where the store wants the publisher's signature and this process cannot sign (a serving node)."""
        return not self.publisher.required or self.publisher.can_sign

    @property
    def signed(self) -> bool:
        return bool(self.key) or self.publisher.required

    def index_path(self, oid: str) -> str:
        return f"{self.prefix}/{oid}.json"

    def package_path(self, oid: str) -> str:
        return f"{self.prefix}/{oid}{self.package}"

    def delete(self, name) -> str:
        """Remove the object's index, then its package, from every location; ``NotFound`` if absent everywhere."""
        oid = self.object_id(name)
        rels = (self.index_path(oid), self.package_path(oid)) if self.package else (self.index_path(oid),)
        found = [loc for loc in self.locations if any(loc.size(rel) is not None for rel in rels)]
        if not found:
            raise NotFound(f"no {self.label} {oid} in the store")
        for loc in found:
            for rel in rels:
                loc.remove(rel)
        return oid

    def _read(self, oid: str, accept: Accept | None = None) -> tuple[dict, bytes | None]:
        """(body, the package's bytes or None), of the first valid copy (module doc, step 2)."""

        def parse(raw: bytes, loc: Location) -> tuple[dict, bytes | None]:
            try:
                body = self._parse(raw, oid, accept)
                return body, self._read_package(loc, oid, body) if self.package else None
            except IntegrityError as e:
                raise IntegrityError(f"{loc.url}: {e}") from None

        found, errors = first_valid(self.locations, self.index_path(oid), parse)
        if found is not None:
            return found
        if errors:
            raise IntegrityError(f"no valid copy of {self.label} {oid}: " + "; ".join(errors))
        raise NotFound(f"no {self.label} {oid} in the store")

    def _write(self, oid: str, fields: dict, data: bytes | None = None, accept: Accept | None = None) -> dict:
        """Write ``fields`` (and ``data``, the package) as ``oid`` on every location that takes it (module doc,
        step 1) -> the body written."""
        if not self.can_publish:
            raise InvalidRequest(f"{self.label} {oid}: this store takes {self.plural} signed by the publisher key; "
                                 "this process has none (kept on this machine)")  # fmt: skip
        body = {"format": self.format, "revision": self._revision(oid, accept) + 1, "published": time.time(),
                "by": socket.gethostname(), **fields}  # fmt: skip
        if data is not None:
            body.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        raw = json.dumps({self.wrap: body, "integrity": seal(body, self.key, self.publisher)}, sort_keys=True).encode()

        def put(loc: Location) -> bool:  # the package first, its index after it
            return (data is None or try_put(loc, self.package_path(oid), data)) and try_put(loc, self.index_path(oid), raw)

        if not sum(self.pool.map(put, self.locations)):
            raise LocationUnavailable(f"{self.label} {oid}: no location took it")
        return body

    def _ids(self) -> list[str]:
        """Every id with an index (or a package) on some location that can be listed, sorted."""
        ends = (".json", self.package) if self.package else (".json",)
        ids: set[str] = set()
        for rels in self.pool.map(lambda loc: listed(loc, self.prefix), self.locations):
            ids.update(rel.split("/")[-1].rsplit(".", 1)[0] for rel in rels if rel.endswith(ends))
        return sorted(i for i in ids if ID.match(i))

    def _revision(self, oid: str, accept: Accept | None = None) -> int:
        """The revision of the first valid index (its package unread); 0 if none."""
        body, _ = first_valid(self.locations, self.index_path(oid), lambda raw, loc: self._parse(raw, oid, accept))
        return int(body.get("revision", 0)) if body else 0

    def _parse(self, raw: bytes, oid: str, accept: Accept | None = None) -> dict:
        """The sealed, well-formed body of an index of ``oid``: the one seal check of every kind."""
        what = f"{self.label} {oid}"
        try:
            doc = json.loads(raw)
            body, integrity = doc[self.wrap], doc["integrity"]
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"unreadable {'index of ' if self.package else ''}{what}: {e}") from None
        check_seal(body, integrity, self.key, what, self.publisher)
        if not isinstance(body, dict) or body.get("format") != self.format:
            fmt = body.get("format") if isinstance(body, dict) else None
            raise IntegrityError(f"{what} has unknown format {fmt!r}")
        self.check(body, oid)
        if self.package:
            size, cap = body.get("size"), self.max_package_bytes
            if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= cap:
                raise IntegrityError(f"{what}: index gives size {size!r} (1 .. {cap} bytes)")
            if not isinstance(body.get("sha256"), str) or not _SHA256.match(body["sha256"]):
                raise IntegrityError(f"{what}: index lacks a sha256")
        if accept is not None:
            accept(body)
        return body

    def _read_package(self, loc: Location, oid: str, body: dict) -> bytes:
        """The package on ``loc`` if it is the one ``body`` describes (size first: a huge file is not read)."""
        what, rel = f"{self.label} {oid}", self.package_path(oid)
        try:
            size = loc.size(rel)
            if size is None:
                raise IntegrityError(f"{what}: index without its package")
            if size != body["size"]:
                raise IntegrityError(f"{what}: package is {size} bytes, its index says {body['size']} "
                                     "(truncated or replaced)")  # fmt: skip
            data = loc.get(rel)
        except OSError as e:  # FileNotFoundError too: removed between size and get
            raise IntegrityError(f"{what}: cannot read its package: {e}") from None
        if len(data) != body["size"] or hashlib.sha256(data).hexdigest() != body["sha256"]:
            raise IntegrityError(f"{what}: package does not match its index's sha256 (corrupt or replaced)")
        return data
