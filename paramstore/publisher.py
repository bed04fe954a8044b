"""The publisher key: who may put native code (compiled step packages) and kernel plans in the store.

Every serving node holds the store's HMAC key (it checks manifests with it), so an HMAC proves only that some
node wrote an object: one compromised node could plant a package every other node then dlopens. A store
configured with a publisher key separates writing from reading:

  publisher_pubkey   (``[store] publisher_pubkey`` / ``$PDSERVE_PUBLISHER_PUBKEY``, 64 hex digits) on every
                     process: a step package or a kernel plan is loaded from the store only if its index
                     carries a valid Ed25519 signature by this key (``integrity.check_seal``).
  publisher key      (``[store] publisher_key_file`` / ``$PDSERVE_PUBLISHER_KEY_FILE``, a PEM file made by
                     ``paramstore keygen``) only where objects are published for the fleet: the importer,
                     an admin, a build job. A serving node never takes it (``compute/node/main.py`` drops it):
                     with a public key set and no private one, a node keeps what it builds or measures on
                     its own machine and publishes nothing.

Ed25519 from ``cryptography`` (pyca, a well-kept library): a public-key signature is the primitive here
precisely because the verifiers must not be able to sign. Without a public key configured the store
behaves as before (sha256 and the HMAC seal).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import InvalidRequest

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(slots=True, frozen=True)
class Publisher:
    """The public key objects must be signed by (None: not required) and, where this process publishes for the
    fleet, the private key's PEM (None: it cannot sign)."""

    pubkey: str | None = None  # 64 hex digits: the raw Ed25519 public key
    private_pem: bytes | None = None

    def __post_init__(self) -> None:
        if self.pubkey is not None and not _HEX64.match(self.pubkey):
            raise InvalidRequest(f"publisher_pubkey {self.pubkey[:80]!r}: want 64 lowercase hex digits "
                                 "(`paramstore keygen` prints it)")  # fmt: skip
        if self.private_pem is not None:
            mine = public_hex(self.private_pem)
            if self.pubkey is not None and mine != self.pubkey:
                raise InvalidRequest("the publisher key file does not match publisher_pubkey")

    @property
    def required(self) -> bool:
        return self.pubkey is not None

    @property
    def can_sign(self) -> bool:
        return self.private_pem is not None

    def sign(self, message: bytes) -> str:
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        return load_pem_private_key(self.private_pem, password=None).sign(message).hex()

    def verify(self, message: bytes, signature) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if not isinstance(signature, str) or not re.fullmatch(r"[0-9a-f]{128}", signature):
            return False
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.pubkey)).verify(bytes.fromhex(signature), message)
        except InvalidSignature:
            return False
        return True


def public_hex(private_pem: bytes) -> str:
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        PublicFormat,
        load_pem_private_key,
    )

    try:
        key = load_pem_private_key(private_pem, password=None)
        return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    except (ValueError, TypeError, AttributeError) as e:
        raise InvalidRequest(f"not an Ed25519 private key in PEM: {e}") from None


def generate(path: str) -> str:
    """A new key pair: the private key written to ``path`` (0600, never over an existing file); -> the public
    key's hex."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
    )

    pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise InvalidRequest(f"{path} exists: a publisher key is never overwritten") from None
    except OSError as e:
        raise InvalidRequest(f"cannot write {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return public_hex(pem)


def read_private(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise InvalidRequest(f"cannot read the publisher key file {path}: {e.strerror or e}") from None
    public_hex(pem)  # a clear error now, not at the first publish
    return pem
