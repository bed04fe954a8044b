"""Hashes: xxh3-128 per fragment (fast, checked on every read), a cryptographic shard digest, and the seal
(sha256, HMAC-SHA256 with the store's key, Ed25519 with the publisher key: paramstore/publisher.py) of the
JSON objects the store keeps (manifests, kernel plans, step graphs)."""

from __future__ import annotations

import hashlib
import hmac
import json

import xxhash


def fragment_hash(buf) -> str:
    """xxh3-128 hex of a fragment (~32 GB/s on one core here)."""
    return xxhash.xxh3_128_hexdigest(buf)


def shard_digest(algo: str, buf) -> str:
    """Cryptographic digest of a whole shard: blake3 (~7 GB/s) or sha256 (~2 GB/s)."""
    if algo == "blake3":
        import blake3

        return blake3.blake3(buf, max_threads=blake3.blake3.AUTO if len(buf) > 2**24 else 1).hexdigest()
    if algo == "sha256":
        return hashlib.sha256(buf).hexdigest()
    raise ValueError(f"unknown digest {algo!r}")


def seal(body: dict, key: bytes | None, publisher=None) -> dict:
    """The integrity block of a stored JSON object: sha256 of its canonical body, an HMAC-SHA256 of it when the
    store has a key (manifests, kernel plans, step graphs), and an Ed25519 signature when ``publisher``
    (``paramstore.publisher.Publisher``) can sign (kernel plans, step graphs)."""
    canon = canonical(body)
    out = {"sha256": hashlib.sha256(canon).hexdigest()}
    if key:
        out["hmac_sha256"] = hmac.new(key, canon, hashlib.sha256).hexdigest()
    if publisher is not None and publisher.can_sign:
        out["ed25519"] = publisher.sign(canon)
    return out


def check_seal(body: dict, integrity: dict, key: bytes | None, what: str, publisher=None) -> None:
    """Raise ``IntegrityError`` unless ``integrity`` is ``seal(body, key)``'s (a keyed store refuses unsigned)
    and, where ``publisher`` requires it, carries the publisher key's signature."""
    from .errors import IntegrityError

    canon = canonical(body)
    if not isinstance(integrity, dict) or integrity.get("sha256") != hashlib.sha256(canon).hexdigest():
        raise IntegrityError(f"{what} does not match its hash (corrupt or edited)")
    if key:
        sig = integrity.get("hmac_sha256", "")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, hmac.new(key, canon, hashlib.sha256).hexdigest()):
            raise IntegrityError(f"{what} has a missing or wrong HMAC signature (tampered?)")
    if publisher is not None and publisher.required and not publisher.verify(canon, integrity.get("ed25519")):
        raise IntegrityError(f"{what} is not signed by the publisher key (publisher_pubkey): never loaded")


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
