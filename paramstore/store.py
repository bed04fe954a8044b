"""ParamStore: the facade that the admin CLI and compute nodes use.

Verbs: ``import_model``, ``import_adapter`` (a LoRA adapter of a model: ``adapters``), ``adapter``, ``models``, ``manifest``, ``reader``, ``verify``,
``repair``, ``remove``, ``gc``, ``warm``, ``stats``; kernel plans per machine class
through ``store.plans`` (``plans``), compiled decode-step packages (AOTInductor) through
``store.graphs`` (``graphs``; ``gc`` leaves both alone). See ``locations`` for the
on-disk layout, ``writer`` for the import lifecycle, ``reader`` for reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import adapters as _adapters
from . import writer as _writer
from .catalog import Catalog
from .config import StoreConfig, parse_ref
from .errors import IntegrityError, InvalidRequest
from .graphs import Graphs
from .locations import Location, open_location
from .manifest import Manifest
from .plans import Plans
from .publisher import Publisher
from .reader import ModelReader, ReaderConfig
from .scrub import ShardHealth, repair, verify
from .sources import ModelSource, open_source


@dataclass(slots=True)
class ImportResult:
    manifest: Manifest
    quant_error: dict | None
    seconds: float


class ParamStore:
    def __init__(self, config: StoreConfig):
        self.config = config
        self._locs: dict[str, Location] = {}
        self.locations = [self.location(u) for u in config.locations]
        publisher = Publisher(config.publisher_pubkey, config.publisher_key)  # native code: paramstore/publisher.py
        self.pool = ThreadPoolExecutor(max(8, config.n), thread_name_prefix="paramstore")
        self.catalog = Catalog(self.locations, config.hmac_key, self.pool, publisher)  # manifests
        self.plans = Plans(self.locations, config.hmac_key, self.pool, publisher)  # kernel plans per machine class
        self.graphs = Graphs(self.locations, config.hmac_key, self.pool, publisher)  # compiled steps per class + model

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def location(self, url: str) -> Location:
        if url not in self._locs:
            self._locs[url] = open_location(url, self.config.storage_options)
        return self._locs[url]

    def _manifest_locations(self, m: Manifest) -> list[Location]:
        return [self.location(u) for u in m.locations]

    # --- writing ------------------------------------------------------------------------
    def import_model(self, src: str | ModelSource, name: str, dtype: str = "int8",
                     progress: Callable[[int, int], None] | None = None) -> ImportResult:  # fmt: skip
        """Import a checkpoint as a new version of `name` (see writer's lifecycle)."""
        t0 = time.perf_counter()
        parse_ref(name)  # validates before anything is read or written
        self.config.check_writable()
        if "@" in name:
            raise InvalidRequest(f"import takes a model name, not a version: {name!r}")
        if dtype not in _writer.DTYPES:
            raise InvalidRequest(f"invalid dtype {dtype!r}: {_writer.DTYPE_NAMES}")
        source = open_source(src) if not isinstance(src, ModelSource) else src
        manifest, summary, w = _writer.build_manifest(
            self.config, self.locations, self.pool, source, name, dtype, progress
        )
        manifest = self._publish(manifest, w)
        return ImportResult(manifest, summary.as_dict() if _writer.DTYPES[dtype] is None else None, time.perf_counter() - t0)

    def import_adapter(self, src, base: str, name: str, progress=None, k: int | None = None,
                       m: int | None = None) -> ImportResult:  # fmt: skip
        """Import a PEFT LoRA adapter of model ``base`` (NAME or NAME@vN) as a new version of ``name`` (see adapters'
        lifecycle); ``k``/``m``: its erasure code (None: the base's)."""
        t0 = time.perf_counter()
        base_m = self.manifest(base)  # NotFound names it
        _adapters.check_names(name, base_m, self.models(), self.manifest)
        config = dataclasses.replace(self.config, k=k or base_m.k, m=m or base_m.m)  # validated as it is made
        manifest, w = _adapters.build(config, self.locations, self.pool, src, base_m, name, progress)
        return ImportResult(self._publish(manifest, w), None, time.perf_counter() - t0)

    def adapter(self, ref: str | Manifest, cache=None):
        """A stored adapter's ``LoraAdapter`` (paramstore/lora.py), read through ``cache`` if given."""
        m = ref if isinstance(ref, Manifest) else self.manifest(ref)
        with self.reader(m, cache=cache) as r:
            return _adapters.read(m, r)

    def _publish(self, manifest: Manifest, w: _writer.ShardWriter) -> Manifest:
        """Step 4 of an import: every fragment landed, then the manifest; a failure discards what was written."""
        try:
            w.check_landed(manifest.shards)
            return self.catalog.publish(manifest)
        except BaseException:
            self._discard(w)
            raise

    def _discard(self, w: _writer.ShardWriter) -> None:
        """Best effort after a failed import: remove fragments no published manifest uses."""
        try:
            live = self._referenced()
        except Exception:
            return  # gc will do it
        for loc, rel in w.written:
            if rel.split("/")[2].split(".")[0] not in live:
                loc.remove(rel)

    # --- reading ------------------------------------------------------------------------
    def models(self) -> dict[str, list[int]]:
        return self.catalog.models()

    def manifest(self, ref: str) -> Manifest:
        name, version = parse_ref(ref)
        return self.catalog.load(name, version)

    def reader(self, ref: str | Manifest, config: ReaderConfig | None = None, cache=None) -> ModelReader:
        m = ref if isinstance(ref, Manifest) else self.manifest(ref)
        return ModelReader(m, self._manifest_locations(m), config, cache)

    # --- maintenance --------------------------------------------------------------------
    def verify(self, ref: str, deep: bool = False, progress=None) -> list[ShardHealth]:
        m = self.manifest(ref)
        return verify(m, self._manifest_locations(m), deep, self.pool, progress)

    def repair(self, ref: str, progress=None) -> list[ShardHealth]:
        m = self.manifest(ref)
        report = repair(m, self._manifest_locations(m), self.pool, progress)
        self.catalog.replicate(m)
        return report

    def remove(self, ref: str) -> list[str]:
        """Delete one version (NAME@vN) or every version (NAME); fragments go at the next gc."""
        name, version = parse_ref(ref)
        versions = [version] if version else self.catalog.versions(name)
        if not versions or (version and version not in self.catalog.versions(name)):
            self.manifest(ref)  # raises NotFound with the right message
        for v in versions:
            self.catalog.delete(name, v)
        return [f"{name}@v{v}" for v in versions]

    def _referenced(self) -> set[str]:
        """Digests of every shard some manifest names; refuses to guess if a manifest is unreadable."""
        live: set[str] = set()
        for name, versions in self.catalog.models().items():
            for v in versions:
                try:
                    m = self.catalog.read(name, v)
                except IntegrityError as e:
                    raise IntegrityError(f"refusing to collect garbage: {e}") from None
                live.update(s.digest for s in m.shards)
        return live

    def gc(self, grace_s: float = 3600.0) -> dict:
        """Delete fragments no manifest references and older than grace_s (in-flight imports are younger)."""
        live = self._referenced()
        now = time.time()
        removed = kept_young = 0
        freed = 0
        for loc in self.locations:
            for rel in loc.list("shards") + loc.list("tmp"):
                digest = rel.split("/")[-1].split(".")[0]
                if rel.startswith("shards/") and digest in live:
                    continue
                mtime = loc.mtime(rel)
                if grace_s > 0 and (mtime is None or now - mtime < grace_s):
                    kept_young += 1
                    continue
                freed += loc.size(rel) or 0
                loc.remove(rel)
                removed += 1
        return {"removed": removed, "bytes_freed": freed, "kept_young": kept_young}

    def warm(self, ref: str, cache, config: ReaderConfig | None = None, progress=None) -> dict:
        """Pre-stage a model's shards into a node cache (what the autoscaler calls before a node starts)."""
        m = self.manifest(ref)
        t0 = time.perf_counter()
        hits = 0
        with self.reader(m, config, cache) as r:
            for s in m.shards:
                hits += r.read(s).cache_hit
                if progress:
                    progress()
        return {"model": m.ref, "shards": len(m.shards), "already_cached": hits,
                "bytes": m.model_bytes, "seconds": time.perf_counter() - t0}  # fmt: skip

    def stats(self) -> dict:
        out = {"locations": [], "models": 0, "versions": 0}
        models = self.models()
        out["models"], out["versions"] = len(models), sum(len(v) for v in models.values())
        for loc in self.locations:
            try:
                rels = loc.list("shards")
                out["locations"].append({"url": loc.url, "fragments": len(rels),
                                         "bytes": sum(loc.size(r) or 0 for r in rels), "ok": True})  # fmt: skip
            except OSError as e:
                out["locations"].append({"url": loc.url, "ok": False, "error": str(e)})
        return out
