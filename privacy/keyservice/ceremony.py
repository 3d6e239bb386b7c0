"""The key ceremony: one silo makes the consortium's key, every other silo receives it sealed to itself.

Any layer that asks for the key service (`fedlt.aggregation.registry.KeyKind`) has its key moved this way;
the ceremony handles the key only as bytes (`SharedSecret.secret_bytes`, and the layer's `from_secret_bytes`
to open them). Each silo that accepts such a layer has an **enrollment key**, an X25519 key pair it keeps in
its state directory; it announces the public half signed with its certificate key (`Announcement`), and the
aggregator keeps the announcements. The silo the consortium names as key holder checks each announcement
against the roster (`MemberTrust`, as it checks any peer), seals the secret key to it (`seal`: an ephemeral
X25519 key, HKDF-SHA256, ChaCha20-Poly1305) and signs the sealed envelope; the aggregator relays envelopes it
cannot open. A silo opens only an envelope addressed to it, signed by the roster's silo the RoundSpec names as
key holder, whose key id matches (`open_sealed`). Rotation is the same path with a new key. The aggregator
holds the key's public part only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlt.aggregation.registry import SharedSecret
from fedlt.errors import FedltError
from privacy.crypto import transcript
from privacy.pki.errors import PkiError
from privacy.pki.identity import MemberTrust
from privacy.pki.signing import verify

# named for ckks, the first layer with a key service: a domain separator, so a new name would refuse every
# enrollment key silos announced before
ANNOUNCE_CONTEXT = "fedlt/ckks/enrollment/v1"
# an envelope binds the layer whose key it seals (v2): one enrollment key serves every layer with the key
# service, and a key sealed as one layer's must not open as another's (envelopes are made at each share)
SEAL_CONTEXT = "fedlt/keyservice/sealed-key/v2"
SEAL_INFO = b"fedlt/keyservice/seal/v2"


class CeremonyError(FedltError):
    """An announcement or sealed context this silo will not accept."""


@dataclass(frozen=True)
class Announcement:
    """A silo's enrollment public key, signed with its certificate key, and that certificate (PEM)."""

    silo: str
    public: bytes
    signature: bytes
    certificate: bytes = field(default=b"", repr=False)

    def message(self, consortium: str) -> bytes:
        return transcript(consortium, self.silo, self.public)


@dataclass(frozen=True)
class SealedContext:
    """The secret key for one recipient, sealed to its enrollment key and signed by the key holder."""

    sender: str
    recipient: str
    context_id: str
    ephemeral: bytes
    ciphertext: bytes = field(repr=False)
    signature: bytes = b""

    def message(self, consortium: str, layer: str) -> bytes:
        return transcript(
            consortium, layer, self.sender, self.recipient, self.context_id, self.ephemeral, self.ciphertext
        )


def announce(consortium: str, silo: str, enrollment: X25519PrivateKey, sign) -> Announcement:
    public = enrollment.public_key().public_bytes_raw()
    unsigned = Announcement(silo, public, b"")
    return Announcement(silo, public, sign(unsigned.message(consortium), context=ANNOUNCE_CONTEXT))


def check_announcement(announcement: Announcement, consortium: str, members: MemberTrust) -> None:
    """A roster silo's own announcement, or CeremonyError: the key holder seals to nobody else."""
    try:
        cert = members.silo(announcement.certificate, announcement.silo)
        verify(cert, announcement.signature, announcement.message(consortium), context=ANNOUNCE_CONTEXT)
    except PkiError as exc:
        raise CeremonyError(f"the enrollment key announced for {announcement.silo}: {exc}") from None
    if len(announcement.public) != 32:
        raise CeremonyError(
            f"{announcement.silo} announced an enrollment key of {len(announcement.public)} bytes"
        )
    try:  # a low-order point makes every exchange all zeros, which X25519 refuses: refuse it here, by name
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(announcement.public))
    except ValueError:
        raise CeremonyError(f"{announcement.silo} announced a low-order enrollment key") from None


def _key(shared: bytes, consortium: str, layer: str, sender: str, recipient: str, context_id: str) -> bytes:
    info = SEAL_INFO + transcript(consortium, layer, sender, recipient, context_id)
    return HKDF(hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def seal(
    secret: SharedSecret, *, consortium: str, layer: str, sender: str, recipient: Announcement, sign
) -> SealedContext:
    """`secret`, the key of `layer`, sealed to `recipient`'s enrollment key and signed by `sender`."""
    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient.public))
    key = _key(shared, consortium, layer, sender, recipient.silo, secret.context_id)
    ephemeral_public = ephemeral.public_key().public_bytes_raw()
    aad = transcript(consortium, layer, sender, recipient.silo, secret.context_id, ephemeral_public)
    ciphertext = ChaCha20Poly1305(key).encrypt(bytes(12), secret.secret_bytes(), aad)  # a fresh key each time
    unsigned = SealedContext(sender, recipient.silo, secret.context_id, ephemeral_public, ciphertext)
    signature = sign(unsigned.message(consortium, layer), context=SEAL_CONTEXT)
    return SealedContext(sender, recipient.silo, secret.context_id, ephemeral_public, ciphertext, signature)


def open_sealed(
    sealed: SealedContext,
    *,
    consortium: str,
    layer: str,
    me: str,
    enrollment: X25519PrivateKey,
    holder: str,
    holder_certificate: bytes,
    members: MemberTrust,
    read: Callable[[bytes], SharedSecret],
) -> SharedSecret:
    """The secret key of `layer`, read by its `read` (`KeyKind.from_secret_bytes`), if `sealed` is addressed
    to `me`, signed by the roster's silo `holder` as a key of `layer`, and holds the key it names;
    CeremonyError otherwise."""
    if sealed.recipient != me or sealed.sender != holder:
        raise CeremonyError(
            f"a sealed context from {sealed.sender} to {sealed.recipient}; expected {holder} to {me}"
        )
    try:
        cert = members.silo(holder_certificate, holder)
        verify(cert, sealed.signature, sealed.message(consortium, layer), context=SEAL_CONTEXT)
    except PkiError as exc:
        raise CeremonyError(f"the sealed context's signature: {exc}") from None
    try:
        shared = enrollment.exchange(X25519PublicKey.from_public_bytes(sealed.ephemeral))
        key = _key(shared, consortium, layer, sealed.sender, me, sealed.context_id)
        aad = transcript(consortium, layer, sealed.sender, me, sealed.context_id, sealed.ephemeral)
        secret = read(ChaCha20Poly1305(key).decrypt(bytes(12), sealed.ciphertext, aad))
    except (InvalidTag, ValueError) as exc:  # ValueError: bytes that are no key of the layer's kind
        raise CeremonyError(f"the sealed context does not open: {type(exc).__name__}") from None
    if secret.context_id != sealed.context_id:
        raise CeremonyError("the sealed context holds another key than it names")
    return secret


def fingerprint(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:16]
