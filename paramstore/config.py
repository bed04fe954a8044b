"""Configuration of the parameter store (StoreConfig), and the config file every command reads.

StoreConfig says where fragments live and how they are coded. The rest of this module reads the
one TOML config file of pdserve (its layout is below, at "the config file") and turns the
[store] table plus the store flags into a StoreConfig; the other tables are checked here
against their components' dataclasses by the commands that own them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    publisher_pubkey: str | None = None  # Ed25519 (64 hex): plans and step packages load only signed by it
    publisher_key: bytes | None = None  # its private key (PEM): only where objects are published for the fleet

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


# --- the config file ---------------------------------------------------------------------
# One TOML file configures every `pdserve` and `paramstore` command: `--config FILE`, else
# $PDSERVE_CONFIG, else $PARAMSTORE_CONFIG (the older name, kept as an alias). Its tables:
#   [store]       this module (StoreConfig): locations, root, k, m, shard_mb, digest, hmac_key_file, storage_options,
#                 publisher_pubkey, publisher_key_file (paramstore/publisher.py; $PDSERVE_PUBLISHER_PUBKEY, _KEY_FILE)
#   [node]        compute.node.config.NodeConfig          (`pdserve node`, the nodes `pdserve up` starts)
#   [gateway]     gateway.config.GatewayConfig (+ url)     (`pdserve gateway` / `up`; `url` for autoscale/status/chat)
#   [autoscaler]  autoscaler.config.AutoscalerConfig (+ actuator, [autoscaler.local], [autoscaler.kubernetes])
# Precedence, per setting: command-line flag > environment variable > config file > default.
# An unknown table or key is a ConfigError: one line, exit 2.

CONFIG_ENV = ("PDSERVE_CONFIG", "PARAMSTORE_CONFIG")  # looked up in this order when --config is not given
SECTIONS = ("store", "node", "gateway", "autoscaler")
STORE_KEYS = ("locations", "root", "k", "m", "shard_mb", "digest", "hmac_key_file", "storage_options",
              "publisher_pubkey", "publisher_key_file")


class ConfigError(InvalidRequest):
    """The config file (or a flag or variable standing for one of its settings) is wrong: fix it."""


def config_path(flag: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The config file to read: --config, else $PDSERVE_CONFIG, else $PARAMSTORE_CONFIG, else none."""
    env = os.environ if env is None else env
    return flag or next((env[k] for k in CONFIG_ENV if env.get(k)), None)


def read_config(path: str | None) -> dict[str, dict]:
    """The file's tables by section ({} for none / no file); unknown tables are a ConfigError."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config {path}: unknown table or key {', '.join(map(repr, unknown))} "
                          f"(tables: {', '.join(f'[{s}]' for s in SECTIONS)})")  # fmt: skip
    for name, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"config {path}: {name} must be a table [{name}], not a value")
    return {name: dict(table) for name, table in doc.items()}


def env_secret(name: str, file: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """A secret: the file `file` (a flag), else $NAME, else the file $NAME_FILE names; None when none is set."""
    env = os.environ if env is None else env
    path = file or (None if env.get(name) else env.get(name + "_FILE"))
    if not path:
        return env[name].strip() if env.get(name) else None
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {name} from {path}: {e.strerror or e}") from None


def check_keys(table: Mapping[str, Any], known, section: str, path: str | None, hints: Mapping[str, str] = {}) -> None:
    """ConfigError for the first key of `table` not in `known` (with a hint where one is given)."""
    for key in table:
        if key in hints:
            raise ConfigError(f"config {path}: [{section}] {key} is not a file setting: {hints[key]}")
        if key not in known:
            names = ", ".join(sorted(set(known) - set(hints)))
            raise ConfigError(f"config {path}: unknown key {key!r} in [{section}] (known: {names})")


def table_kwargs(cls, table: Mapping[str, Any], section: str, path: str | None, hints: Mapping[str, str] = {},
                 skip: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """The keys of `table` that are fields of dataclass `cls`, type-checked against each field's default.

    Keys in `skip` are the caller's own (handled before); `hints` names keys that must not be in a
    file (secrets) and where they go instead.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_keys(table, set(fields) | set(skip), section, path, hints)
    out = {}
    for key, value in table.items():
        if key in skip:
            continue
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # fmt: skip
        out[key] = _typed(value, default, f"config {path}: [{section}] {key}")
    return out


def resolve(cls, section: str, tables: Mapping[str, dict], path: str | None, flags: Mapping[str, Any],
            env: Mapping[str, Any] = {}, hints: Mapping[str, str] = {},
            skip: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Keyword arguments for dataclass `cls`: flags > env > the file's [section] > (cls's defaults).

    `flags` and `env` map field names to values, None where not given.
    """
    kw = table_kwargs(cls, tables.get(section, {}), section, path, hints, skip)
    kw.update({k: v for k, v in env.items() if v is not None})
    kw.update({k: v for k, v in flags.items() if v is not None})
    return kw


def _typed(value: Any, default: Any, where: str) -> Any:
    """`value` from TOML, checked against the type of the field's `default` (None: anything goes)."""
    if value is None or default is None:
        return value
    if isinstance(value, bool) != isinstance(default, bool):
        raise ConfigError(f"{where} = {value!r}: expected {type(default).__name__}")
    if isinstance(default, float) and isinstance(value, int):
        return float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"{where} = {value!r}: expected {type(default).__name__}")
    return value


def add_store_arguments(p) -> None:
    """--store/--config/--hmac-key-file, as every command that opens the store takes them."""
    p.add_argument("--store", action="append", metavar="URL",
                   help=f"a store location URL (repeat for each); default: [store] locations, else k+m "
                        f"local directories under {DEFAULT_ROOT}")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the TOML config file (else $PDSERVE_CONFIG / $PARAMSTORE_CONFIG)")
    p.add_argument("--hmac-key-file", metavar="FILE",
                   help="sign manifests on write, refuse unsigned or tampered ones on read ([store] hmac_key_file)")


def publisher_keys(t: Mapping[str, Any], where: str) -> dict[str, Any]:
    """publisher_pubkey / publisher_key (the PEM read) from $PDSERVE_PUBLISHER_PUBKEY / _KEY_FILE, else [store]."""
    from .publisher import read_private

    pub = os.environ.get("PDSERVE_PUBLISHER_PUBKEY") or _typed(t.get("publisher_pubkey", ""), "",
                                                                f"{where} publisher_pubkey")  # fmt: skip
    path = os.environ.get("PDSERVE_PUBLISHER_KEY_FILE") or _typed(t.get("publisher_key_file", ""), "",
                                                                  f"{where} publisher_key_file")  # fmt: skip
    return {"publisher_pubkey": pub.strip().lower() or None, "publisher_key": read_private(path) if path else None}


def store_config(args, k: int | None = None, m: int | None = None, tables: Mapping[str, dict] | None = None,
                 shard_mb: float | None = None) -> StoreConfig:  # fmt: skip
    """--store/--hmac-key-file (args) > [store] of the config file > defaults -> StoreConfig.

    `tables` is the already-read config file (read_config), else the file args.config or the
    environment names is read here.
    """
    path = config_path(getattr(args, "config", None))
    tables = read_config(path) if tables is None else tables
    t = tables.get("store", {})
    check_keys(t, STORE_KEYS, "store", path)
    where = f"config {path}: [store]"
    key = None
    key_file = getattr(args, "hmac_key_file", None) or _typed(t.get("hmac_key_file"), "", f"{where} hmac_key_file")
    if key_file:
        try:
            with open(key_file, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read HMAC key file {key_file}: {e.strerror or e}") from None
        if not key:
            raise ConfigError(f"HMAC key file {key_file} is empty")
    k = k if k is not None else _typed(t.get("k", 8), 8, f"{where} k")
    m = m if m is not None else _typed(t.get("m", 3), 3, f"{where} m")
    options = _typed(t.get("storage_options", {}), {}, f"{where} storage_options")
    kw: dict[str, Any] = {"k": k, "m": m, "hmac_key": key, "storage_options": options}
    kw |= publisher_keys(t, where)
    if "digest" in t:
        kw["digest"] = _typed(t["digest"], "", f"{where} digest")
    mb = shard_mb if shard_mb is not None else t.get("shard_mb")
    if mb is not None:
        kw["shard_bytes"] = int(float(_typed(mb, 1.0, f"{where} shard_mb")) * 2**20)
    locations = getattr(args, "store", None) or _typed(t.get("locations", []), [], f"{where} locations")
    if locations:
        return StoreConfig(locations=list(locations), **kw)
    return StoreConfig.local_default(_typed(t.get("root", DEFAULT_ROOT), "", f"{where} root"), **kw)
