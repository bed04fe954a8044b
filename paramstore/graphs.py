"""Compiled decode steps in the store: one AOTInductor package per machine class, model and graph spec.

A step graph (``torch._inductor.aoti_compile_and_package``: a ``.pt2`` zip of native code, built without
the weights) takes a minute or two of CPU to build and belongs to a class of machine and a model, not to a
node. The first node of a class that builds one publishes it here; every other node of that class loads it
from here instead of compiling. A package is native code a node will dlopen: it is handed out only after
its bytes match the sealed index (size and sha256; the index's seal is an HMAC where the store has a key).

Layout under every location root (replicated, like manifests and kernel plans; a reader takes the first
location whose index is valid *and* whose package matches it)::

    <root>/graphs/<id>.pt2      the package's bytes
    <root>/graphs/<id>.json     its index: {"graph": BODY, "integrity": SEAL}

``id`` is 16 lowercase hex digits (the caller hashes machine key + model digest + graph spec). BODY is
``{"format", "id", "revision", "published", "by", "size", "sha256", "meta"}`` (``meta`` opaque caller
JSON), SEAL ``integrity.seal(BODY, key)``. A publish writes, on each location, the package first and the
index after it (a reader never meets an index whose package is not there yet) and bumps ``revision``; a
delete removes the index first. A reader that meets a re-publish between its package and its index sees a
package that does not match its (older) index: that copy is refused and the next location's taken; if every
copy is caught so, ``get`` raises ``IntegrityError`` and the caller builds its own (as for a corrupt store).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import time

from .catalog import first_valid, listed, try_put
from .errors import IntegrityError, InvalidRequest, LocationUnavailable, NotFound
from .integrity import check_seal, seal
from .locations import Location
from .publisher import Publisher

FORMAT = "pdserve-step-graph/1"
PREFIX = "graphs"
MAX_PACKAGE_BYTES = 512 * 2**20  # an AOTInductor step package is ~1-10 MiB without weights; refuse past this
_ID = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def graph_id(gid: str) -> str:
    """``gid`` if it is a step graph id (16 lowercase hex digits); ``InvalidRequest`` otherwise."""
    if not isinstance(gid, str) or not _ID.match(gid):
        raise InvalidRequest(f"not a step graph id: {str(gid)[:60]!r} (16 lowercase hex digits)")
    return gid


def package_path(gid: str) -> str:
    return f"{PREFIX}/{gid}.pt2"


def index_path(gid: str) -> str:
    return f"{PREFIX}/{gid}.json"


class Graphs:
    """The compiled-step packages of one store: list, get, publish, delete (all locations, first valid copy)."""

    def __init__(self, locations: list[Location], key: bytes | None, pool, publisher: Publisher | None = None):
        self.locations, self.key, self.pool = locations, key, pool
        self.publisher = publisher or Publisher()

    @property
    def can_publish(self) -> bool:
        """False where the store wants the publisher's signature and this process cannot sign (a serving node)."""
        return not self.publisher.required or self.publisher.can_sign

    def get(self, gid: str) -> tuple[dict, bytes]:
        """(body, package bytes), verified; NotFound if none; IntegrityError if no copy is valid."""
        gid = graph_id(gid)

        def parse(raw: bytes, loc: Location) -> tuple[dict, bytes]:
            try:
                body = self._parse(raw, gid)
                return body, _read_package(loc, gid, body)
            except IntegrityError as e:
                raise IntegrityError(f"{loc.url}: {e}") from None

        found, errors = first_valid(self.locations, index_path(gid), parse)
        if found is not None:
            return found
        if errors:
            raise IntegrityError(f"no valid copy of step graph {gid}: " + "; ".join(errors))
        raise NotFound(f"no step graph {gid} in the store")

    def publish(self, gid: str, meta: dict, package: bytes) -> dict:
        """Write package + sealed index on every location that takes it -> the body written;
        LocationUnavailable if none."""
        gid = graph_id(gid)
        if not isinstance(meta, dict):
            raise InvalidRequest(f"step graph {gid}: meta must be a JSON object, not {type(meta).__name__}")
        if not isinstance(package, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"step graph {gid}: the package must be bytes, not {type(package).__name__}")
        data = bytes(package)
        if not data:
            raise InvalidRequest(f"step graph {gid}: empty package")
        if len(data) > MAX_PACKAGE_BYTES:
            raise InvalidRequest(f"step graph {gid}: package of {len(data)} bytes is over the "
                                 f"{MAX_PACKAGE_BYTES >> 20} MiB cap (built with the weights inside?)")  # fmt: skip
        if not self.can_publish:
            raise InvalidRequest(f"step graph {gid}: this store takes packages signed by the publisher key; this "
                                 "process has none (kept on this machine)")  # fmt: skip
        revision = self._revision(gid) + 1
        body = {"format": FORMAT, "id": gid, "revision": revision, "published": time.time(),
                "by": socket.gethostname(), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "meta": meta}  # fmt: skip
        try:
            raw = json.dumps({"graph": body, "integrity": seal(body, self.key, self.publisher)}, sort_keys=True).encode()
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"step graph {gid}: meta is not JSON: {e}") from None

        def put(loc: Location) -> bool:  # the package first, its index after it
            return try_put(loc, package_path(gid), data) and try_put(loc, index_path(gid), raw)

        if not sum(self.pool.map(put, self.locations)):
            raise LocationUnavailable(f"step graph {gid}: no location took it")
        return body

    def list(self) -> list[dict]:
        """One row per id (an index or a package without one): id, meta, size, revision, published, by,
        signed, valid (and ``error``: why not). Reads and checks every package, as ``get`` does."""
        ids: set[str] = set()
        for rels in self.pool.map(lambda loc: listed(loc, PREFIX), self.locations):
            ids.update(rel.split("/")[-1].rsplit(".", 1)[0] for rel in rels if rel.endswith((".json", ".pt2")))
        rows = []
        for gid in sorted(i for i in ids if _ID.match(i)):
            try:
                b, _ = self.get(gid)
                rows.append({"id": gid, "meta": b["meta"], "size": b["size"], "revision": b["revision"],
                             "published": b["published"], "by": b["by"], "signed": bool(self.key) or self.publisher.required,
                             "valid": True})  # fmt: skip
            except IntegrityError as e:
                rows.append({"id": gid, "valid": False, "error": str(e)})
            except NotFound:
                rows.append({"id": gid, "valid": False, "error": "a package without an index (a publish cut short)"})
        return rows

    def delete(self, gid: str) -> str:
        """Remove ``gid``'s index, then its package, from every location; NotFound if absent everywhere."""
        gid = graph_id(gid)
        rels = (index_path(gid), package_path(gid))  # the index first: never an index without its package
        found = [loc for loc in self.locations if any(loc.size(rel) is not None for rel in rels)]
        if not found:
            raise NotFound(f"no step graph {gid} in the store")
        for loc in found:
            for rel in rels:
                loc.remove(rel)
        return gid

    def _revision(self, gid: str) -> int:
        """The revision of the first valid index (its package unread); 0 if none."""

        def parse(raw: bytes, loc: Location) -> dict:
            return self._parse(raw, gid)

        body, _ = first_valid(self.locations, index_path(gid), parse)
        return int(body["revision"]) if body else 0

    def _parse(self, raw: bytes, gid: str) -> dict:
        """The sealed, well-formed body of an index naming ``gid``; IntegrityError otherwise."""
        try:
            doc = json.loads(raw)
            body, integrity = doc["graph"], doc["integrity"]
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"unreadable index of step graph {gid}: {e}") from None
        check_seal(body, integrity, self.key, f"step graph {gid}", self.publisher)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise IntegrityError(f"step graph {gid} has unknown format {body.get('format')!r}")
        if body.get("id") != gid:
            raise IntegrityError(f"index of step graph {gid} names {str(body.get('id'))[:40]!r}")
        size, sha = body.get("size"), body.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_PACKAGE_BYTES:
            raise IntegrityError(f"step graph {gid}: index gives size {size!r} (1 .. {MAX_PACKAGE_BYTES} bytes)")
        if not isinstance(sha, str) or not _SHA256.match(sha) or not isinstance(body.get("meta"), dict):
            raise IntegrityError(f"step graph {gid}: index lacks a sha256 or a meta object")
        if not isinstance(body.get("revision"), int):
            raise IntegrityError(f"step graph {gid}: index lacks a revision")
        return body


def _read_package(loc: Location, gid: str, body: dict) -> bytes:
    """The package on ``loc`` if it is the one ``body`` describes (size first: a huge file is not read)."""
    rel = package_path(gid)
    try:
        size = loc.size(rel)
        if size is None:
            raise IntegrityError(f"step graph {gid}: index without its package")
        if size != body["size"]:
            raise IntegrityError(f"step graph {gid}: package is {size} bytes, its index says {body['size']} "
                                 "(truncated or replaced)")  # fmt: skip
        data = loc.get(rel)
    except OSError as e:  # FileNotFoundError too: removed between size and get
        raise IntegrityError(f"step graph {gid}: cannot read its package: {e}") from None
    if len(data) != body["size"] or hashlib.sha256(data).hexdigest() != body["sha256"]:
        raise IntegrityError(f"step graph {gid}: package does not match its index's sha256 (corrupt or replaced)")
    return data
