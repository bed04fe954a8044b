"""Kernel plans in the store: one measured plan per class of machine, beside the models.

A kernel plan (``compute.kernels.int8``' table: the int8 kernel per weight shape and M bucket) belongs to a
class of machine — CPU model, ISA flags, torch's dispatch level, torch version, threads — not to a node.
The first node of a class that measures publishes its plan here; every other node or pod of that class
reads it and does not measure (a node holds no state the pool cannot give back).

Layout under every location root (replicated, like manifests; a reader takes the first valid copy)::

    <root>/plans/<id>.json      id = the machine key's hash (its first word, 16 hex digits)

Each object is ``{"plan": BODY, "integrity": SEAL}``: BODY is ``{"format", "key", "revision",
"published", "by", "table"}`` (``key`` the full machine key, ``table`` opaque here: compute reads it),
SEAL the sha256 of BODY's canonical JSON and, when the store has an HMAC key, its signature
(``integrity.seal``). A publish overwrites (``revision`` + 1; a table merged with the shapes already
there is the caller's choice); there is no claim race to win: two nodes of one class measure the same.
"""

from __future__ import annotations

import json
import re
import socket
import time

from .catalog import first_valid, listed, try_put
from .errors import IntegrityError, InvalidRequest, LocationUnavailable, NotFound
from .integrity import check_seal, seal
from .locations import Location
from .publisher import Publisher

FORMAT = "pdserve-kernel-plan/1"
PREFIX = "plans"
_ID = re.compile(r"^[0-9a-f]{16}$")


def plan_id(key: str) -> str:
    """The object id of a machine key (``compute.kernels.int8.machine_key``: '<16 hex> <description>')."""
    pid = key.split(" ", 1)[0]
    if not _ID.match(pid):
        raise InvalidRequest(f"not a machine key or plan id: {key[:60]!r} (16 hex digits first)")
    return pid


def plan_path(pid: str) -> str:
    return f"{PREFIX}/{pid}.json"


class Plans:
    """The plans of one store: ``list``, ``get``, ``publish``, ``delete`` (all locations, first valid copy)."""

    def __init__(self, locations: list[Location], key: bytes | None, pool, publisher: Publisher | None = None):
        self.locations, self.key, self.pool = locations, key, pool
        self.publisher = publisher or Publisher()

    @property
    def can_publish(self) -> bool:
        """False where the store wants the publisher's signature and this process cannot sign (a serving node)."""
        return not self.publisher.required or self.publisher.can_sign

    def get(self, key: str) -> dict:
        """The verified body of ``key``'s plan; ``NotFound`` if none, ``IntegrityError`` if no copy is valid
        (corrupt, unsigned where the store signs, or naming another machine key)."""
        pid = plan_id(key)

        def parse(raw: bytes, loc: Location) -> dict:
            try:
                body = self._parse(raw, pid)
            except IntegrityError as e:
                raise IntegrityError(f"{loc.url}: {e}") from None
            if key != pid and body.get("key") != key:
                raise IntegrityError(f"{loc.url}: plan {pid} is for {str(body.get('key'))[:80]!r}, not this machine")
            return body

        body, errors = first_valid(self.locations, plan_path(pid), parse)
        if body is not None:
            return body
        if errors:
            raise IntegrityError(f"no valid copy of kernel plan {pid}: " + "; ".join(errors))
        raise NotFound(f"no kernel plan {pid} in the store")

    def publish(self, key: str, table: dict) -> dict:
        """Write ``table`` as ``key``'s plan on every location that takes it; -> the body written."""
        pid = plan_id(key)
        if not self.can_publish:
            raise InvalidRequest(f"kernel plan {pid}: this store takes plans signed by the publisher key; this "
                                 "process has none (kept on this machine)")  # fmt: skip
        try:
            revision = int(self.get(key).get("revision", 0)) + 1
        except (NotFound, IntegrityError):
            revision = 1
        body = {"format": FORMAT, "key": key, "revision": revision, "published": time.time(),
                "by": socket.gethostname(), "table": table}  # fmt: skip
        raw = json.dumps({"plan": body, "integrity": seal(body, self.key, self.publisher)}, sort_keys=True).encode()
        ok = sum(self.pool.map(lambda loc: try_put(loc, plan_path(pid), raw), self.locations))
        if not ok:
            raise LocationUnavailable(f"kernel plan {pid}: no location took it")
        return body

    def list(self) -> list[dict]:
        """One row per plan id: key, revision, shapes, published, signed, valid (and why not)."""
        ids: set[str] = set()
        for _, rels in self.pool.map(lambda loc: (loc, listed(loc, PREFIX)), self.locations):
            ids.update(rel.split("/")[-1][:-5] for rel in rels if rel.endswith(".json"))
        rows = []
        for pid in sorted(i for i in ids if _ID.match(i)):
            try:
                b = self.get(pid)
                rows.append({"id": pid, "key": b.get("key"), "revision": b.get("revision"),
                             "shapes": len((b.get("table") or {}).get("shapes", {})), "published": b.get("published"),
                             "by": b.get("by"), "signed": bool(self.key) or self.publisher.required, "valid": True})  # fmt: skip
            except (IntegrityError, NotFound) as e:
                rows.append({"id": pid, "valid": False, "error": str(e)})
        return rows

    def delete(self, key: str) -> str:
        pid = plan_id(key)
        found = [loc for loc in self.locations if loc.size(plan_path(pid)) is not None]
        if not found:
            raise NotFound(f"no kernel plan {pid} in the store")
        for loc in found:
            loc.remove(plan_path(pid))
        return pid

    def _parse(self, raw: bytes, pid: str) -> dict:
        try:
            doc = json.loads(raw)
            body, integrity = doc["plan"], doc["integrity"]
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"unreadable kernel plan {pid}: {e}") from None
        check_seal(body, integrity, self.key, f"kernel plan {pid}", self.publisher)
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("table"), dict):
            raise IntegrityError(f"kernel plan {pid} has unknown format {body.get('format')!r}")
        return body
