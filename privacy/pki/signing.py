"""Signatures by consortium members, each bound to one purpose.

A signature covers `len(context) || context || data`, where the context names a purpose and its version
("fedlt/roundspec/v1"). One member key signs several kinds of message (RoundSpecs now, secure-aggregation keys
later); without the context, bytes signed as one kind could be replayed as another that happens to parse
them. The 4-byte length prefix keeps the boundary unambiguous: ("ab", "c") and ("a", "bc") sign differently.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from privacy.pki.errors import PkiError
from privacy.pki.identity import describe

_ALGORITHM = ec.ECDSA(hashes.SHA256())
ROUNDSPEC_CONTEXT = "fedlt/roundspec/v1"  # the aggregator signs RoundSpecs for this purpose only


def load_private_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    """Refuses a key file that group or others may read, as ssh does: such a key may already be copied."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        pem = path.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read private key {path}: {exc.strerror}") from None
    if os.name == "posix" and mode & 0o077:
        raise PkiError(
            f"private key {path} is accessible by group or others (mode {mode & 0o777:04o}); "
            f"restrict it with `chmod 600 {path}`"
        )
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PkiError(f"{path} is not an ECDSA P-256 key, the only kind a consortium uses")
    return key


def sign(key: ec.EllipticCurvePrivateKey | str | os.PathLike[str], data: bytes, *, context: str) -> bytes:
    """A DER ECDSA signature over `data` for the purpose `context`; `key` is a key or a key file's path."""
    private = key if isinstance(key, ec.EllipticCurvePrivateKey) else load_private_key(key)
    return private.sign(_message(context, data), _ALGORITHM)


def verify(cert: x509.Certificate, signature: bytes, data: bytes, *, context: str) -> None:
    """Checks the signature only; whether `cert` belongs to the consortium is `verify_chain`'s question."""
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise PkiError(f"{describe(cert)} does not hold an ECDSA key")
    verify_key(public, signature, data, context=context, signer=describe(cert))


def verify_key(
    public: ec.EllipticCurvePublicKey, signature: bytes, data: bytes, *, context: str, signer: str = "the key"
) -> None:
    try:
        public.verify(signature, _message(context, data), _ALGORITHM)
    except InvalidSignature:
        raise PkiError(
            f"signature does not verify: these bytes were not signed for {context!r} by {signer}"
        ) from None


def _message(context: str, data: bytes) -> bytes:
    tag = context.encode()
    if not tag:
        raise ValueError("a signature needs a context naming its purpose, e.g. 'fedlt/roundspec/v1'")
    return len(tag).to_bytes(4, "big") + tag + data
