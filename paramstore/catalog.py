"""The catalog: which models and versions exist, and publishing a new version.

Manifests are replicated to every location (``models/<name>/v000001.json``).
Publishing claims version N by an exclusive create on the *arbiter* (the first
location): local ``os.link``, S3 ``If-None-Match: *``. Losing the race moves to
N+1, so two concurrent imports of one name make two versions, never a torn one.
After the claim the manifest is copied to the other locations; a reader takes
the first copy that passes its hash/HMAC check, so a partial copy-out is harmless
(``repair`` completes it).

Unreachable locations (a partition: calls hang until their timeouts, paramstore/locations.py): a listing waits
for the others at most ``LISTING_GRACE_S`` after the first answer (manifests are replicated: any reachable copy
will do; a publish that missed a version still claims exclusively on the arbiter); a location that failed lately,
or did not answer a listing in that grace, is asked last for a copy (``locations.by_health``) and its fragments are
read last (``reader.py``).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .config import validate_name
from .errors import ConflictRetry, IntegrityError, LocationUnavailable, NotFound
from .health import by_health, mark_failed, suspect
from .locations import Location
from .manifest import Manifest, manifest_path, parse_manifest_path

MAX_CLAIMS = 64
LISTING_GRACE_S = 2.0  # after the first location's listing, how long the others may take to be counted


class Catalog:
    def __init__(self, locations: list[Location], key: bytes | None, pool: ThreadPoolExecutor, publisher=None):
        """``publisher`` (paramstore/publisher.py): manifests signed by it on publish, required on read where set."""
        self.locations = locations
        self.key, self.publisher = key, publisher
        self.pool = pool

    def _listing(self, prefix: str = "models") -> dict[tuple[str, int], list[Location]]:
        found: dict[tuple[str, int], list[Location]] = {}

        def ls(loc: Location):
            try:
                return loc, loc.list(prefix)
            except OSError:
                mark_failed(loc)
                return loc, []

        asked = {self.pool.submit(ls, loc): loc for loc in self.locations}
        done, pending = wait(asked, return_when=FIRST_COMPLETED)
        if pending:
            more, pending = wait(pending, timeout=LISTING_GRACE_S)
            done |= more
        for f in pending:  # no answer in the grace: asked last from now on, as if it had failed
            mark_failed(asked[f])
        for loc, rels in (f.result() for f in done):
            for rel in rels:
                parsed = parse_manifest_path(rel)
                if parsed:
                    found.setdefault(parsed, []).append(loc)
        return found

    def models(self) -> dict[str, list[int]]:
        """name -> sorted versions."""
        out: dict[str, list[int]] = {}
        for name, version in self._listing():
            out.setdefault(name, []).append(version)
        return {n: sorted(v) for n, v in sorted(out.items())}

    def versions(self, name: str) -> list[int]:
        validate_name(name)
        return sorted(v for (n, v) in self._listing(f"models/{name}") if n == name)

    def load(self, name: str, version: int | None = None) -> Manifest:
        """A verified manifest: the pinned version, or the latest."""
        versions = self.versions(name)
        if not versions:
            raise NotFound(f"model {name!r} not found in the store")
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise NotFound(f"model {name}@v{version} not found (versions: {', '.join(f'v{v}' for v in versions)})")
        return self.read(name, version)

    def read(self, name: str, version: int) -> Manifest:
        return self._read(name, version)[0]

    def _read(self, name: str, version: int) -> tuple[Manifest, bytes]:
        """The first valid copy: (manifest, its bytes as stored)."""

        def parse(raw: bytes, loc: Location) -> tuple[Manifest, bytes]:
            m = Manifest.from_json(raw, self.key, where=f"{name}@v{version} on {loc.url}", publisher=self.publisher)
            if m.name != name or m.version != version:
                raise IntegrityError(f"{loc.url}: manifest names {m.ref}, expected {name}@v{version}")
            return m, raw

        got, errors = first_valid(self.locations, manifest_path(name, version), parse)
        if got is not None:
            return got
        if errors:
            raise IntegrityError(f"no valid copy of {name}@v{version}: " + "; ".join(errors))
        raise NotFound(f"model {name}@v{version} not found")

    def publish(self, manifest: Manifest) -> Manifest:
        """Assign the next free version and write the manifest last; returns it with its version."""
        arbiter = self.locations[0]
        version = max(self.versions(manifest.name), default=0) + 1
        for _ in range(MAX_CLAIMS):
            manifest.version = version
            raw = manifest.to_json(self.key, self.publisher)
            try:
                claimed = arbiter.put_exclusive(manifest_path(manifest.name, version), raw)
            except OSError as e:
                raise LocationUnavailable(f"cannot publish on {arbiter.url}: {e}") from None
            if claimed:
                rel = manifest_path(manifest.name, version)
                list(self.pool.map(lambda loc: try_put(loc, rel, raw), self.locations[1:]))
                return manifest
            version += 1
        raise ConflictRetry(f"could not claim a version of {manifest.name} after {MAX_CLAIMS} tries")

    def replicate(self, manifest: Manifest) -> int:
        """Copy a manifest (the bytes of a valid copy, its seal as it is) to every location that lacks it; returns
        copies written."""
        rel = manifest_path(manifest.name, manifest.version)
        raw = self._read(manifest.name, manifest.version)[1]
        missing = [loc for loc in self.locations if loc.size(rel) is None]
        return sum(self.pool.map(lambda loc: try_put(loc, rel, raw), missing))

    def delete(self, name: str, version: int) -> None:
        rel = manifest_path(name, version)
        # arbiter last: the version number stays claimed until every copy is gone
        for loc in self.locations[1:] + self.locations[:1]:
            loc.remove(rel)

    def all_manifests(self) -> list[Manifest]:
        out = []
        for name, versions in self.models().items():
            for v in versions:
                try:
                    out.append(self.read(name, v))
                except (IntegrityError, NotFound):
                    continue
        return out


def first_valid(locations: list[Location], rel: str, parse):
    """(the first copy of ``rel`` that ``parse(raw, loc)`` accepts, the reasons the copies before it were not);
    (None, reasons) if none is. ``parse`` raises ``IntegrityError`` for a copy it refuses; an absent copy is no
    reason, an unreadable location is one (the object is replicated: manifests, kernel plans). Locations that failed
    lately are asked last, and not at all once another has answered (a partition would cost each its timeouts)."""
    errors, answered = [], False  # answered: a location that has not failed lately said whether it has a copy
    for loc in by_health(locations):
        if answered and suspect(loc):  # the rest failed lately: a replicated object is not there alone
            break
        try:
            raw = loc.get(rel)
        except FileNotFoundError:
            answered = answered or not suspect(loc)
            continue
        except OSError as e:
            mark_failed(loc)
            errors.append(f"{loc.url}: {e}")
            continue
        try:
            return parse(raw, loc), errors
        except IntegrityError as e:
            errors.append(str(e))
    return None, errors


def try_put(loc: Location, rel: str, raw: bytes) -> bool:
    try:
        loc.put(rel, raw)
        return True
    except OSError:
        return False


def listed(loc: Location, prefix: str) -> list[str]:
    """The paths under ``prefix`` of one location; [] if it cannot be listed (a replicated object's other copies)."""
    try:
        return loc.list(prefix)
    except OSError:
        return []
