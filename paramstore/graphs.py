"""Compiled decode steps in the store: one AOTInductor package per machine class, model and graph spec.

A step graph (``torch._inductor.aoti_compile_and_package``: a ``.pt2`` zip of native code, built without
the weights) takes a minute or two of CPU to build and belongs to a class of machine and a model, not to a
node. The first node of a class that builds one publishes it here; every other node of that class loads it
from here instead of compiling. A package is native code a node will dlopen: it is handed out only after
its bytes match the sealed index (size and sha256; the index's seal is an HMAC where the store has a key).

Layout under every location root (a package and its sealed index, ``artefacts.py``: replicated; a reader
takes the first location whose index is valid *and* whose package matches it)::

    <root>/graphs/<id>.pt2      the package's bytes
    <root>/graphs/<id>.json     its index: {"graph": BODY, "integrity": SEAL}

``id`` is 16 lowercase hex digits (the caller hashes machine key + model digest + graph spec). BODY is
``{"format", "id", "revision", "published", "by", "size", "sha256", "meta"}`` (``meta`` opaque caller
JSON). A publish writes the package first and the index after it and bumps ``revision``; a delete removes
the index first. If every copy is caught mid-publish or damaged, ``get`` raises ``IntegrityError`` and the
caller builds its own (as for a corrupt store).
"""

from __future__ import annotations

import json

from .artefacts import ID, SealedObjects
from .errors import IntegrityError, InvalidRequest, NotFound

FORMAT = "pdserve-step-graph/1"
PREFIX = "graphs"
MAX_PACKAGE_BYTES = 512 * 2**20  # an AOTInductor step package is ~1-10 MiB without weights; refuse past this


def graph_id(gid: str) -> str:
    """``gid`` if it is a step graph id (16 lowercase hex digits); ``InvalidRequest`` otherwise."""
    if not isinstance(gid, str) or not ID.match(gid):
        raise InvalidRequest(f"not a step graph id: {str(gid)[:60]!r} (16 lowercase hex digits)")
    return gid


def package_path(gid: str) -> str:
    return f"{PREFIX}/{gid}.pt2"


def index_path(gid: str) -> str:
    return f"{PREFIX}/{gid}.json"


class Graphs(SealedObjects):
    """The compiled-step packages of one store: list, get, publish, delete (all locations, first valid copy)."""

    prefix, wrap, format, label, plural, package = PREFIX, "graph", FORMAT, "step graph", "packages", ".pt2"

    @property
    def max_package_bytes(self) -> int:  # read at each call (a test lowers it)
        return MAX_PACKAGE_BYTES

    def object_id(self, gid: str) -> str:
        return graph_id(gid)

    def check(self, body: dict, gid: str) -> None:
        if body.get("id") != gid:
            raise IntegrityError(f"index of step graph {gid} names {str(body.get('id'))[:40]!r}")
        if not isinstance(body.get("meta"), dict):
            raise IntegrityError(f"step graph {gid}: index lacks a meta object")
        if not isinstance(body.get("revision"), int):
            raise IntegrityError(f"step graph {gid}: index lacks a revision")

    def get(self, gid: str) -> tuple[dict, bytes]:
        """(body, package bytes), verified; NotFound if none; IntegrityError if no copy is valid."""
        return self._read(graph_id(gid))

    def publish(self, gid: str, meta: dict, package: bytes) -> dict:
        """Write package + sealed index on every location that takes it -> the body written;
        LocationUnavailable if none."""
        gid = graph_id(gid)
        if not isinstance(meta, dict):
            raise InvalidRequest(f"step graph {gid}: meta must be a JSON object, not {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"step graph {gid}: meta is not JSON: {e}") from None
        if not isinstance(package, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"step graph {gid}: the package must be bytes, not {type(package).__name__}")
        data = bytes(package)
        if not data:
            raise InvalidRequest(f"step graph {gid}: empty package")
        if len(data) > MAX_PACKAGE_BYTES:
            raise InvalidRequest(f"step graph {gid}: package of {len(data)} bytes is over the "
                                 f"{MAX_PACKAGE_BYTES >> 20} MiB cap (built with the weights inside?)")  # fmt: skip
        return self._write(gid, {"id": gid, "meta": meta}, data)

    def list(self) -> list[dict]:
        """One row per id (an index or a package without one): id, meta, size, revision, published, by,
        signed, valid (and ``error``: why not). Reads and checks every package, as ``get`` does."""
        rows = []
        for gid in self._ids():
            try:
                b, _ = self.get(gid)
                rows.append({"id": gid, "meta": b["meta"], "size": b["size"], "revision": b["revision"],
                             "published": b["published"], "by": b["by"], "signed": self.signed, "valid": True})  # fmt: skip
            except IntegrityError as e:
                rows.append({"id": gid, "valid": False, "error": str(e)})
            except NotFound:
                rows.append({"id": gid, "valid": False, "error": "a package without an index (a publish cut short)"})
        return rows
