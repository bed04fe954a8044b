"""Content hashes of full KV blocks: the key a cached block is found by, on any node.

Block ``i`` of a token list (tokens ``[i*B, (i+1)*B)``, full blocks only) is named by a chain::

    h[0] = sha256(ROOT                    | extra keys | salt | tokens of block 0)
    h[i] = sha256(h[i-1] (32 bytes)       | extra keys |      | tokens of block i)

so a hash names the block *and everything before it*: two prompts share block ``i``'s hash only if
they agree on every token up to its end. The byte encoding is canonical and process-independent (no
per-process seed, unlike Python's ``hash``): a version tag, then each field length-prefixed, token ids
as little-endian u32. The gateway and other nodes compute the same values.

*Extra keys* are whatever changes a block's numbers besides its tokens: the model reference and
version, the KV dtype, the block size (``extra_keys``). The optional per-request ``cache_salt``
enters block 0 only; since every later hash chains from it, a salted request shares no block with
another salt or with unsalted requests (tenant isolation: a shared prefix cache is a timing side
channel).

Why SHA-256 and not the store's xxh3-128: a collision here serves one request's KV to another (a
wrong answer, or cache poisoning by a crafted prompt: vLLM moved its default to SHA-256 after such an
advisory against a fast non-cryptographic hash). xxh3 is built for speed, not adversarial inputs.
SHA-256 costs ~2 GB/s here: a 16-token block is 64 bytes plus 32 of parent, ~1 µs per block, ~0.1 ms
for a 1,500-token prompt, noise beside its prefill.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

VERSION = b"pdserve-prefix-v1"
ROOT = hashlib.sha256(VERSION).digest()  # block 0's parent
HASH_BYTES = 32
MIN_COMPUTED = 2  # tokens a hit leaves to compute at least: never a one-token (decode path) prefill chunk


def extra_keys(model: str = "", kv_dtype: str = "", block_size: int = 0) -> tuple[str, ...]:
    """The extra keys of an engine's blocks (the same in every process serving that model the same way).
    ``model``: its reference@version and runtime weights (int8 | bf16 | fp32), e.g. ``smollm2@v1/int8``."""
    return (f"model={model}", f"kv_dtype={kv_dtype}", f"block_size={block_size}")


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def block_hash(parent: bytes, token_ids: Sequence[int], extra: Sequence[str] = (), salt: str | None = None) -> bytes:
    """The hash of one full block after ``parent`` (``ROOT`` for block 0); ``salt`` only for block 0."""
    h = hashlib.sha256(VERSION)
    h.update(_field(parent))
    h.update(struct.pack("<I", len(extra)))
    for key in extra:
        h.update(_field(key.encode()))
    h.update(_field(b"" if salt is None else b"\x01" + salt.encode()))  # None and "" differ
    h.update(_field(struct.pack(f"<{len(token_ids)}I", *token_ids)))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra: Sequence[str] = (), salt: str | None = None,
                 start: int = 0, parent: bytes | None = None) -> list[bytes]:  # fmt: skip
    """Chained hashes of the full blocks of ``token_ids`` (a partial tail block has none).

    ``start`` / ``parent``: go on from block ``start`` whose parent hash is ``parent`` (extending a
    chain already computed: the salt entered block 0 and is not repeated)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if (start == 0) != (parent is None):
        raise ValueError("give parent exactly when start > 0")
    out, prev = [], ROOT if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        prev = block_hash(prev, token_ids[i * block_size : (i + 1) * block_size], extra, salt if i == 0 else None)
        out.append(prev)
    return out


def prompt_hashes(token_ids: Sequence[int], block_size: int, extra: Sequence[str] = (),
                  salt: str | None = None) -> list[bytes]:  # fmt: skip
    """The hashes of the blocks of a prompt that a cache hit may cover: whole blocks, at least ``MIN_COMPUTED``
    tokens left after them (as an engine caps a hit: compute/engine/prefix_cache.py). The one place the
    gateway's index, a peer's export and a pull's check name a prompt's blocks."""
    usable = max(0, len(token_ids) - MIN_COMPUTED) // block_size
    return block_hashes(token_ids[: usable * block_size], block_size, extra, salt)
