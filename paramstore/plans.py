"""Kernel plans in the store: one measured plan per class of machine, beside the models.

A kernel plan (``compute.kernels.int8``' table: the int8 kernel per weight shape and M bucket) belongs to a
class of machine — CPU model, ISA flags, torch's dispatch level, torch version, threads — not to a node.
The first node of a class that measures publishes its plan here; every other node or pod of that class
reads it and does not measure (a node holds no state the pool cannot give back).

Layout under every location root (a sealed index alone, ``artefacts.py``: replicated, first valid copy)::

    <root>/plans/<id>.json      id = the machine key's hash (its first word, 16 hex digits)

Each object is ``{"plan": BODY, "integrity": SEAL}``: BODY is ``{"format", "key", "revision",
"published", "by", "table"}`` (``key`` the full machine key, ``table`` opaque here: compute reads it).
A publish overwrites (``revision`` + 1; a table merged with the shapes already there is the caller's
choice); a copy naming another machine key under this id is refused.
"""

from __future__ import annotations

from .artefacts import ID, SealedObjects
from .errors import IntegrityError, InvalidRequest, NotFound

FORMAT = "pdserve-kernel-plan/1"
PREFIX = "plans"


def plan_id(key: str) -> str:
    """The object id of a machine key (``compute.kernels.int8.machine_key``: '<16 hex> <description>')."""
    pid = key.split(" ", 1)[0]
    if not ID.match(pid):
        raise InvalidRequest(f"not a machine key or plan id: {key[:60]!r} (16 hex digits first)")
    return pid


def plan_path(pid: str) -> str:
    return f"{PREFIX}/{pid}.json"


class Plans(SealedObjects):
    """The plans of one store: ``list``, ``get``, ``publish``, ``delete`` (all locations, first valid copy)."""

    prefix, wrap, format, label, plural = PREFIX, "plan", FORMAT, "kernel plan", "plans"

    def object_id(self, key: str) -> str:
        return plan_id(key)

    def check(self, body: dict, pid: str) -> None:
        if not isinstance(body.get("table"), dict):
            raise IntegrityError(f"kernel plan {pid} has unknown format {body.get('format')!r}")

    def get(self, key: str) -> dict:
        """The verified body of ``key``'s plan; ``NotFound`` if none, ``IntegrityError`` if no copy is valid
        (corrupt, unsigned where the store signs, or naming another machine key)."""
        pid = plan_id(key)
        return self._read(pid, _for_key(key, pid))[0]

    def publish(self, key: str, table: dict) -> dict:
        """Write ``table`` as ``key``'s plan on every location that takes it; -> the body written."""
        pid = plan_id(key)
        return self._write(pid, {"key": key, "table": table}, accept=_for_key(key, pid))

    def list(self) -> list[dict]:
        """One row per plan id: key, revision, shapes, published, signed, valid (and why not)."""
        rows = []
        for pid in self._ids():
            try:
                b = self.get(pid)
                rows.append({"id": pid, "key": b.get("key"), "revision": b.get("revision"),
                             "shapes": len((b.get("table") or {}).get("shapes", {})), "published": b.get("published"),
                             "by": b.get("by"), "signed": self.signed, "valid": True})  # fmt: skip
            except (IntegrityError, NotFound) as e:
                rows.append({"id": pid, "valid": False, "error": str(e)})
        return rows


def _for_key(key: str, pid: str):
    """A plan asked for by its full machine key must name that key (asked for by id: any)."""

    def accept(body: dict) -> None:
        if key != pid and body.get("key") != key:
            raise IntegrityError(f"plan {pid} is for {str(body.get('key'))[:80]!r}, not this machine")

    return accept
