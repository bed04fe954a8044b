"""Storage locations: one failure domain each, addressed by an fsspec URL.

Layout under every location root (each holds at most one fragment of any shard)::

    <root>/models/<name>/v000001.json            manifest of name@v1 (replicated to every location)
    <root>/shards/<d[:2]>/<digest>.k<K>n<N>.f<I>  fragment I of the shard whose digest is <digest>
    <root>/plans/<id>.json                        a kernel plan per machine class (``plans``; replicated)
    <root>/graphs/<id>.pt2, <id>.json             a compiled decode step and its sealed index (``graphs``)
    <root>/tmp/<random>                           local backend only: staging before rename

Fragments are content-addressed and immutable: a fragment is staged and then
committed (local: write to tmp/, fsync, ``os.replace``; S3/Alluxio: one PUT,
atomic by the protocol). A manifest is published last, by exclusive create.

Backends, registered in one lazy factory (``open_location``):
``file`` (plain paths; os calls, ``readinto`` zero-copy), ``s3`` (s3fs),
``memory`` (fsspec's in-process memory fs, for unit tests) and ``alluxio+<ufs>``
(alluxiofs over an under-store, e.g. ``alluxio+s3://bucket/prefix``).
"""

from __future__ import annotations

import abc
import functools
import os
import threading
import uuid
from collections.abc import Callable

from .errors import InvalidRequest, LocationUnavailable


class Location(abc.ABC):
    """One storage location. Paths are relative to its root, '/'-separated."""

    url: str

    @abc.abstractmethod
    def put(self, rel: str, data) -> None:
        """Write an object atomically (readers see all of it or nothing), overwriting."""

    @abc.abstractmethod
    def put_exclusive(self, rel: str, data) -> bool:
        """Create an object only if it does not exist; False if it already did."""

    @abc.abstractmethod
    def get(self, rel: str) -> bytes:
        """Read a whole object; FileNotFoundError if absent."""

    def readinto(self, rel: str, buf: memoryview) -> int:
        """Read an object into buf (exactly its size); returns bytes read."""
        data = self.get(rel)
        n = min(len(data), len(buf))
        buf[:n] = data[:n]
        return len(data)

    @abc.abstractmethod
    def size(self, rel: str) -> int | None:
        """Size of an object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every object below prefix (recursive), as paths relative to the root."""

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Delete an object; absent is not an error."""

    def mtime(self, rel: str) -> float | None:
        """Modification time (unix seconds) if the backend knows it."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalLocation(Location):
    """A local directory (one disk or mount = one failure domain)."""

    def __init__(self, url: str):
        self.url = url
        self.root = url

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def _stage(self, data) -> str:
        tmp_dir = os.path.join(self.root, "tmp")
        os.makedirs(tmp_dir, exist_ok=True)
        tmp = os.path.join(tmp_dir, uuid.uuid4().hex)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, rel, data):
        dst = self._p(rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = self._stage(data)
        os.replace(tmp, dst)

    def put_exclusive(self, rel, data):
        dst = self._p(rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = self._stage(data)
        try:
            os.link(tmp, dst)  # atomic create-if-absent
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, rel):
        with open(self._p(rel), "rb") as f:
            return f.read()

    def readinto(self, rel, buf):
        with open(self._p(rel), "rb", buffering=0) as f:
            total = 0
            while total < len(buf):
                n = f.readinto(buf[total:])
                if not n:
                    break
                total += n
            return total

    def size(self, rel):
        try:
            return os.stat(self._p(rel)).st_size
        except FileNotFoundError:
            return None

    def mtime(self, rel):
        try:
            return os.stat(self._p(rel)).st_mtime
        except FileNotFoundError:
            return None

    def list(self, prefix):
        base = self._p(prefix)
        out = []
        for dirpath, _, files in os.walk(base):
            for fn in files:
                out.append(os.path.relpath(os.path.join(dirpath, fn), self.root).replace(os.sep, "/"))
        return sorted(out)

    def remove(self, rel):
        try:
            os.unlink(self._p(rel))
        except FileNotFoundError:
            pass


def _transport_errors() -> tuple[type, ...]:
    """What an fsspec backend raises for a network failure that is no OSError (botocore's ConnectTimeoutError,
    aiohttp's errors): looked up only when something was raised."""
    errors: list[type] = []
    try:
        from botocore.exceptions import BotoCoreError

        errors.append(BotoCoreError)
    except ImportError:
        pass
    try:
        from aiohttp import ClientError

        errors.append(ClientError)
    except ImportError:
        pass
    return tuple(errors)


def _io(fn):
    """A location call whose network failure is ``LocationUnavailable`` (an OSError: the callers' retry-elsewhere
    path), not a botocore error that no ``except OSError`` catches."""

    @functools.wraps(fn)
    def call(self, *args):
        try:
            return fn(self, *args)
        except OSError:
            raise
        except _transport_errors() as e:
            raise LocationUnavailable(f"{self.url}: {type(e).__name__}: {e}") from None

    return call


class FsspecLocation(Location):
    """Any fsspec filesystem (s3, memory, alluxio): one PUT per object is atomic there. Its calls' network failures
    are ``LocationUnavailable`` (``_io``)."""

    _create_lock = threading.Lock()  # memory:// has no conditional put; one process owns it

    def __init__(self, url: str, fs, root: str):
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    @_io
    def put(self, rel, data):
        self.fs.pipe_file(self._p(rel), bytes(data))

    @_io
    def put_exclusive(self, rel, data):
        path = self._p(rel)
        if self.fs.protocol in ("memory",) or "memory" in tuple(self.fs.protocol):
            with self._create_lock:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, bytes(data))
                return True
        try:
            self.fs.pipe_file(path, bytes(data), mode="create")  # S3: IfNoneMatch="*"
            return True
        except FileExistsError:
            return False
        except OSError as e:  # botocore surfaces 412 PreconditionFailed as a generic error
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise

    @_io
    def get(self, rel):
        return self.fs.cat_file(self._p(rel))

    @_io
    def size(self, rel):
        try:
            return int(self.fs.info(self._p(rel))["size"])
        except FileNotFoundError:
            return None

    @_io
    def mtime(self, rel):
        try:
            info = self.fs.info(self._p(rel))
        except FileNotFoundError:
            return None
        t = info.get("LastModified") or info.get("mtime") or info.get("created")
        if t is None:
            return None
        return t.timestamp() if hasattr(t, "timestamp") else float(t)

    @_io
    def list(self, prefix):
        base = self._p(prefix).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self.root.lstrip("/")
        return sorted(p.lstrip("/")[len(root) + 1 :] for p in found)

    @_io
    def remove(self, rel):
        try:
            self.fs.rm_file(self._p(rel))
        except FileNotFoundError:
            pass


class AlluxioLocation(FsspecLocation):
    """alluxiofs turns every failure into a bare ``Exception("fallback to ufs is failed")``.

    We ask ``exists`` first so absence stays a FileNotFoundError, and re-raise
    anything else as OSError so callers keep their retry-vs-give-up semantics.
    """

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - alluxiofs raises bare Exception
            raise OSError(f"alluxio: {e}") from None

    def _exists(self, rel: str) -> bool:
        return bool(self._call(self.fs.exists, self._p(rel)))

    def put(self, rel, data):
        self._call(super().put, rel, data)

    def put_exclusive(self, rel, data):
        with self._create_lock:  # no conditional put through alluxiofs: exclusive within one process
            if self._exists(rel):
                return False
            self.put(rel, data)
            return True

    def get(self, rel):
        if not self._exists(rel):
            raise FileNotFoundError(rel)
        return self._call(super().get, rel)

    def size(self, rel):
        return self._call(super().size, rel) if self._exists(rel) else None

    def mtime(self, rel):
        return self._call(super().mtime, rel) if self._exists(rel) else None

    def list(self, prefix):
        return self._call(super().list, prefix) if self._exists(prefix) else []

    def remove(self, rel):
        if self._exists(rel):
            self._call(super().remove, rel)


# S3 calls give up in seconds, not botocore's 60 s per connect: an unreachable location (a partition: connects hang,
# nothing is refused) is then one failed location, and the reader takes other fragments (tests/net). A read's
# timeout is between bytes, not for the whole object. The options' own config_kwargs override these.
S3_TIMEOUTS = {"connect_timeout": 2, "read_timeout": 20, "retries": {"max_attempts": 2, "mode": "standard"}}


def _open_s3(url: str, options: dict) -> Location:
    import s3fs

    opts = {"skip_instance_cache": True, "use_listings_cache": False, **options}
    opts["config_kwargs"] = {**S3_TIMEOUTS, **options.get("config_kwargs", {})}
    fs = s3fs.S3FileSystem(**opts)
    return FsspecLocation(url, fs, url.split("://", 1)[1])


def _open_memory(url: str, options: dict) -> Location:
    from fsspec.implementations.memory import MemoryFileSystem

    return FsspecLocation(url, MemoryFileSystem(), "/" + url.split("://", 1)[1].lstrip("/"))


def _open_alluxio(url: str, options: dict) -> Location:
    """alluxio+<ufs>://path: alluxiofs in front of the under-store <ufs>.

    With ``{"skip_alluxio": True}`` in options (no Alluxio cluster, as on this
    machine and in tests) alluxiofs runs in pass-through mode to the under-store.
    """
    import logging

    from alluxiofs import AlluxioFileSystem

    scheme, rest = url.split("://", 1)
    ufs = scheme.split("+", 1)[1] if "+" in scheme else "file"
    opts = dict(options)
    test_options = {"skip_alluxio": True} if opts.pop("skip_alluxio", False) else {}
    target_options = opts.pop("target_options", {"auto_mkdir": True} if ufs == "file" else {})
    fs = AlluxioFileSystem(
        target_protocol=ufs,
        target_options=target_options,
        logger=logging.getLogger("paramstore.alluxio"),
        test_options=test_options,
        skip_instance_cache=True,
        **opts,
    )
    root = ("/" + rest.lstrip("/")) if ufs == "file" else f"{ufs}://{rest}"
    return AlluxioLocation(url, fs, root)


_BACKENDS: dict[str, Callable[[str, dict], Location]] = {
    "s3": _open_s3,
    "memory": _open_memory,
    "alluxio": _open_alluxio,
}


def open_location(url: str, storage_options: dict[str, dict] | None = None) -> Location:
    """The one factory of location backends; imports a backend's library only when used."""
    if "://" not in url:
        return LocalLocation(url)
    scheme = url.split("://", 1)[0]
    family = scheme.split("+", 1)[0]
    opener = _BACKENDS.get(family)
    if opener is None:
        raise InvalidRequest(f"unsupported location scheme {scheme!r} in {url}; use a path, s3://, memory:// or alluxio+<ufs>://")
    options = dict((storage_options or {}).get(family, {}))
    try:
        return opener(url, options)
    except ImportError as e:
        raise InvalidRequest(f"location {url} needs an optional dependency: {e}") from None
    except (OSError, ValueError) as e:
        raise LocationUnavailable(f"cannot open location {url}: {e}") from None
