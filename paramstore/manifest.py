"""The versioned manifest of one imported model: everything a reader needs.

A manifest (``models/<name>/v000003.json`` on every location) describes the
model (HF config, dtype, quantization scheme), the codec, the locations and,
per shard, its digest, size, layers, tensors and where each fragment lives with
its xxh3-128 hash. The JSON carries an integrity block: the sha256 of its
canonical body, and an HMAC-SHA256 of it when the store has a key. A reader
refuses a manifest whose hash or signature does not match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .errors import IntegrityError
from .integrity import check_seal, seal

FORMAT = "pdserve-manifest/1"


@dataclass(slots=True)
class FragmentRef:
    index: int  # 0..k-1 data, k..n-1 parity
    location: int  # index into Manifest.locations
    xxh3: str  # xxh3-128 hex of the fragment bytes


@dataclass(slots=True)
class ShardInfo:
    index: int  # position in load order
    kind: str  # bundle | embed | layers | head
    digest: str  # cryptographic digest (Manifest.digest) of the shard bytes; content address
    size: int  # shard bytes before padding
    fragment_size: int  # bytes per fragment (shard padded to k * fragment_size)
    layers: list[int] = field(default_factory=list)  # transformer blocks carried (possibly partially)
    tensors: list[str] = field(default_factory=list)  # tensor names carried
    fragments: list[FragmentRef] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.index:04d}-{self.kind}"

    def fragment_path(self, k: int, n: int, index: int) -> str:
        d = self.digest
        return f"shards/{d[:2]}/{d}.k{k}n{n}.f{index:03d}"


@dataclass(slots=True)
class Manifest:
    name: str
    version: int
    created: float  # unix seconds
    dtype: str  # int8 | int4 | bf16 | fp32 (storage dtype of 2-D weights; int4: the layers' linears, the rest int8)
    quant: dict | None  # {"scheme": ..., "scale_suffix": ...} for int8; int4 adds group_size, zero_suffix
    config: dict  # HF config.json
    k: int
    m: int
    digest: str  # blake3 | sha256
    locations: list[str]
    shards: list[ShardInfo]
    source: dict = field(default_factory=dict)  # {"format": hf|gguf, "path": ..., "quant_error": {...}}
    # a LoRA adapter's (paramstore/adapters.py): {base (NAME@vN), digest, scalings, ranks, targets, peft}; None: a model
    adapter: dict | None = None
    format: str = FORMAT

    @property
    def n(self) -> int:
        return self.k + self.m

    @property
    def ref(self) -> str:
        return f"{self.name}@v{self.version}"

    @property
    def stored_bytes(self) -> int:
        return sum(s.fragment_size * self.n for s in self.shards)

    @property
    def model_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def weight_shards(self) -> list[ShardInfo]:
        return [s for s in self.shards if s.kind != "bundle"]

    def bundle_shard(self) -> ShardInfo | None:
        return next((s for s in self.shards if s.kind == "bundle"), None)

    def to_json(self, key: bytes | None = None, publisher=None) -> bytes:
        body = asdict(self)
        doc = {"manifest": body, "integrity": seal(body, key, publisher)}
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: bytes | None = None, where: str = "", publisher=None) -> "Manifest":
        try:
            doc = json.loads(raw)
            body, integrity = doc["manifest"], doc["integrity"]
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"unreadable manifest {where}: {e}") from None
        check_seal(body, integrity, key, f"manifest {where}", publisher)
        if body.get("format") != FORMAT:
            raise IntegrityError(f"manifest {where} has unknown format {body.get('format')!r}")
        shards = [
            ShardInfo(**{**s, "fragments": [FragmentRef(**f) for f in s["fragments"]]}) for s in body["shards"]
        ]
        return cls(**{**body, "shards": shards})


def manifest_path(name: str, version: int) -> str:
    return f"models/{name}/v{version:06d}.json"


def parse_manifest_path(rel: str) -> tuple[str, int] | None:
    """'models/<name>/v000003.json' -> (name, 3); anything else -> None."""
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != "models" or not parts[2].startswith("v") or not parts[2].endswith(".json"):
        return None
    try:
        return parts[1], int(parts[2][1:-5])
    except ValueError:
        return None
