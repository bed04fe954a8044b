"""The models the gateway serves, and each one's text bundle (tokenizer, chat template, context).

Lifecycle of one model here:
 1. named: listed in the config (``GatewayConfig.models``: exactly those), or — the list empty —
    found in the store (``ParamStore.models()``: every model name it holds), listed at start and
    listed again every ``refresh_s`` and on a request for a name not seen yet (at most once per
    ``MISS_RELIST_S``: a client asking for junk names does not list the store per request);
 2. first used: its text bundle is read from the store in a worker thread (manifest -> bundle
    shard -> ``TextBundle``), once — concurrent first requests wait on the same load;
 3. kept for the life of the gateway (a bundle is a few MB); a model that leaves the store's
    listing is no longer served, its bundle dropped.
A LoRA adapter in the store is served under its own name like a model: its ``Text`` is its base's bundle with the
adapter's version and digest; a new version imported while the gateway runs replaces it at the next listing.
A model whose bundle cannot serve text (no tokenizer: a token-ids-only import) is left out of the
served names from its first read on (the gateway reads every served bundle in the background at
start). So is one whose manifest or bundle fails its integrity check (a manifest edited or not signed
with the store's key; a bundle whose bytes are not its signed digest: the chat template is never
rendered from bytes the manifest does not vouch for): *refused*, read again at each listing (a store
repaired or a model re-imported is served again). A name not served is ``UnknownModel`` (HTTP 404,
saying why). ``Text`` is what the API layer needs of a model: the bundle, its context length
(``max_model_len``: the config's, else the model's) and vocabulary.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from compute.engine.sampling import AdapterRef
from compute.modeling.tokenizer import TextBundle

log = logging.getLogger("pdserve.gateway")
MISS_RELIST_S = 2.0  # a request for an unknown name lists the store again at most this often


class UnknownModel(LookupError):
    """The gateway does not serve this model (HTTP 404): the message lists what it serves."""


@dataclass(slots=True)
class Text:
    """One model's text side: what validating, tokenizing and detokenizing a request needs. A LoRA adapter's
    (``adapter`` set) is its base's, and its requests go to the nodes of its base (``routed``)."""

    name: str
    bundle: TextBundle
    max_model_len: int  # context limit, in tokens
    vocab_size: int  # token ids are 0 .. vocab_size - 1 (read once: the tokenizer is slow to ask)
    adapter: AdapterRef | None = None  # a LoRA adapter (paramstore/adapters.py): its version and digest
    base: str = ""  # an adapter's base, NAME@vN as it was made for

    @property
    def routed(self) -> str:
        """The model whose nodes run this name's requests (its own; an adapter's base model)."""
        return self.base.split("@")[0] if self.adapter is not None else self.name


def text_from_store(ps, name: str, max_model_len: int | None = None) -> Text:
    """Read `name`'s bundle from an open ParamStore (blocking) -> Text."""
    from paramstore import ReaderConfig

    m = ps.manifest(name)  # its hash, and its HMAC signature where the store has a key: IntegrityError
    adapter, base = None, ""
    if m.adapter is not None:  # a LoRA adapter: its base's text, its own version and digest
        adapter, base = AdapterRef(m.ref, m.adapter["digest"]), m.adapter["base"]
        m = ps.manifest(base)
    with ps.reader(m, ReaderConfig(verify_digest="always")) as r:  # a few MB: the digest costs a millisecond
        bundle = TextBundle.from_files(r.bundle())
    ctx = max_model_len or int(m.config.get("max_position_embeddings", 2048))
    return Text(name, bundle, ctx, bundle.tokenizer.get_vocab_size(with_added_tokens=True), adapter, base)


class ModelCatalogue:
    """Served model names and their lazily loaded ``Text``; `store` is an open ParamStore (or None:
    only the `preloaded` texts are served — tests and in-process gateways built from a bundle)."""

    def __init__(self, store, names: list[str] | tuple[str, ...] = (), refresh_s: float = 30.0,
                 max_model_len: int | None = None, preloaded: dict[str, Text] | None = None):  # fmt: skip
        self.store = store
        self.fixed = list(dict.fromkeys(names))  # configured: served exactly; empty: the store's listing
        self.refresh_s, self.max_model_len = refresh_s, max_model_len
        self._texts: dict[str, Text] = dict(preloaded or {})
        self._unservable: dict[str, str] = {}  # name -> why its bundle cannot serve text
        self._refused: set[str] = set()  # of those, the ones that failed an integrity check (checked again)
        self._loading: dict[str, asyncio.Future] = {}
        self._listed: list[str] = list(self._texts)
        self._listed_at = 0.0
        self._bases: dict[str, tuple[int, str | None]] = {}  # store name -> (latest version, its base if an adapter)
        self._lock = threading.Lock()  # listing may run in a worker thread

    # --- which models ------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The served model names, in config order (else the store's, sorted); with a configured list, the store's
        LoRA adapters of those models too."""
        names = self.fixed + [n for n in self._listed if n not in self.fixed] if self.fixed else self._listed
        return [n for n in names if n not in self._unservable]

    def relist(self) -> list[str]:
        """List the store now, and read the refused models again (blocking; no store: a no-op)."""
        if self.store is None:
            return self.names
        self._recheck()
        try:
            versions = self.store.models()
            listed = sorted(versions)
            if self.fixed:  # the configured models, and the adapters of those
                served = {f.split("@")[0] for f in self.fixed}
                listed = self.fixed + [n for n in listed if n not in self.fixed
                                       and (self._base(n, versions[n][-1]) or "").split("@")[0] in served]
        except Exception as e:  # noqa: BLE001 - a store that does not answer keeps the last listing
            log.warning("listing the store's models failed: %s", e)
            versions, listed = {}, self._listed
        with self._lock:
            self._listed, self._listed_at = listed, time.monotonic()
            for gone in set(self._texts) - set(listed):
                self._texts.pop(gone, None)
            for name, t in list(self._texts.items()):  # an adapter imported again: its new version from now on
                if t.adapter is not None and versions.get(name) and t.adapter.ref != f"{name}@v{versions[name][-1]}":
                    self._texts.pop(name, None)
            for gone in self._refused - set(listed):  # removed from the store: nothing left to refuse
                self._refused.discard(gone)
                self._unservable.pop(gone, None)
        return self.names

    async def refresh(self, force: bool = False) -> None:
        """List the store again if the last listing is older than refresh_s (or `force`: a miss)."""
        age = time.monotonic() - self._listed_at
        if self.store is None or age < (MISS_RELIST_S if force else self.refresh_s):
            return
        await asyncio.to_thread(self.relist)

    def _base(self, name: str, version: int) -> str | None:
        """(worker thread) The base of ``name``'s latest version if it is an adapter (its manifest read once per
        version); None for a model or a manifest that cannot be read now."""
        known = self._bases.get(name)
        if known is None or known[0] != version:
            try:
                m = self.store.manifest(f"{name}@v{version}")
            except Exception:  # noqa: BLE001 - unreadable now: not served as an adapter until it reads
                return None
            known = self._bases[name] = (version, m.adapter["base"] if m.adapter is not None else None)
        return known[1]

    def _recheck(self) -> None:
        """(worker thread) Read each refused model again: served again once it verifies."""
        for name in sorted(self._refused):
            try:
                t = text_from_store(self.store, name, self.max_model_len)
            except Exception as e:  # noqa: BLE001 - still refused (or the store not answering): the next listing tries
                log.debug("model %s: still not served: %s", name, e)
                continue
            with self._lock:
                self._texts[name] = t
                self._refused.discard(name)
                self._unservable.pop(name, None)
            log.warning("model %s: its manifest and bundle verify again: served", name)

    async def check(self, name: str) -> None:
        """UnknownModel unless `name` is served (a name not seen yet lists the store again first)."""
        if name not in self.names:
            await self.refresh(force=True)
        if name not in self.names:
            raise UnknownModel(self.unknown_message(name))

    def unknown_message(self, name: str) -> str:
        if name in self._unservable:
            return f"model {name!r} cannot be served by this gateway: {self._unservable[name]}"
        served = ", ".join(repr(n) for n in self.names) or "no model (the store holds none)"
        return f"model {name!r} does not exist; this gateway serves {served}"

    # --- the text of one model ---------------------------------------------------------------
    def loaded(self) -> dict[str, Text]:
        return dict(self._texts)

    async def text(self, name: str) -> Text:
        """`name`'s Text, read from the store on first use (UnknownModel if not served)."""
        await self.check(name)
        if (t := self._texts.get(name)) is not None:
            return t
        fut = self._loading.get(name)
        if fut is None:
            fut = self._loading[name] = asyncio.ensure_future(asyncio.to_thread(self._load, name))
            fut.add_done_callback(lambda _f: self._loading.pop(name, None))
        return await asyncio.shield(fut)

    def text_sync(self, name: str) -> Text:
        """The same, blocking (the OpenAPI document; startup)."""
        if (t := self._texts.get(name)) is not None:
            return t
        return self._load(name)

    def _load(self, name: str) -> Text:
        if self.store is None:
            raise UnknownModel(self.unknown_message(name))
        from paramstore.errors import IntegrityError, NotFound

        t0 = time.monotonic()
        try:
            t = text_from_store(self.store, name, self.max_model_len)
        except NotFound as e:
            raise UnknownModel(f"model {name!r} is served but not readable from the store: {e}") from None
        except IntegrityError as e:  # tampered or corrupt beyond repair: refused, never served as it reads
            with self._lock:
                self._unservable[name] = f"the store's copy fails its integrity check ({e}); repair or re-import it"
                self._refused.add(name)
            log.error("model %s is not served: %s", name, e)
            raise UnknownModel(self.unknown_message(name)) from None
        except ValueError as e:  # the bundle has no tokenizer: token ids only, no text to serve
            self._unservable[name] = str(e)
            log.warning("model %s is not served: %s", name, e)
            raise UnknownModel(self.unknown_message(name)) from None
        with self._lock:
            self._texts[name] = t
        log.info("model %s: text bundle loaded in %.2f s (context %d)", name, time.monotonic() - t0, t.max_model_len)
        return t

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
