"""Key agreement, authenticated envelopes and transcripts, all from `cryptography`, for every layer.

`transcript` encodes, in every layer, what silos sign, what keys are derived over and what envelopes bind.
Every key `agree` derives names its purpose, the session (for secagg: round id and which secure sum) and the
unordered pair of silos in its HKDF info, so a key, mask or envelope from one round, sum or pair is useless in
any other: a replayed message fails to decrypt or to cancel, it never silently mixes in.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlt.errors import FedltError

KEY_BYTES = 32
NONCE_BYTES = 12


class CryptoError(FedltError):
    """A key that is not a valid X25519 public key, or an envelope that fails authentication."""


def transcript(*parts: str | bytes) -> bytes:
    """An unambiguous encoding of several values: each is length-prefixed, so boundaries cannot shift."""
    out = bytearray()
    for part in parts:
        raw = part.encode() if isinstance(part, str) else bytes(part)
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def private_key_from(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


_PROBE = X25519PrivateKey.generate()


def check_public(raw: bytes) -> None:
    """Refuse what cannot be an X25519 peer key: a wrong length, or a low-order point (all-zero secret)."""
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError as exc:
        raise CryptoError(f"not a usable X25519 public key: {exc}") from None


def agree(
    mine: X25519PrivateKey, theirs: bytes, *, purpose: str, session: bytes, pair: tuple[str, str]
) -> bytes:
    """A 32-byte key both ends of `pair` derive alone: X25519, then HKDF-SHA256 bound to the session."""
    try:
        shared = mine.exchange(X25519PublicKey.from_public_bytes(theirs))
    except ValueError as exc:  # wrong length, or a low-order point giving an all-zero secret
        raise CryptoError(f"not a usable X25519 public key: {exc}") from None
    info = transcript(purpose, session, *sorted(pair))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 with a random nonce (both directions of a pair share the key), nonce first."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, blob: bytes, associated: bytes) -> bytes:
    if len(blob) < NONCE_BYTES + 16:
        raise CryptoError("envelope too short")
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], associated)
    except InvalidTag:
        raise CryptoError("envelope fails authentication (wrong key, sender, recipient or session)") from None
