"""Who signed a secure-aggregation message: consortium certificates, or bare keys in a simulation."""

from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric import ec

from privacy.pki.errors import PkiError
from privacy.pki.signing import verify, verify_key
from privacy.pki.trust import MemberTrust
from privacy.secagg.protocol import ProtocolViolation


class ConsortiumPeers:
    """A credential is the signer's certificate, accepted only as `MemberTrust` accepts a silo: issued by the
    consortium CA, valid now, not revoked, and named by the pinned roster under the claimed silo id (a CA
    signature alone would let whoever holds the CA key invent a peer)."""

    def __init__(self, trust: MemberTrust) -> None:
        self.trust = trust

    def verify(self, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str) -> None:
        try:
            verify(self.trust.silo(credential, silo), signature, data, context=context)
        except PkiError as exc:
            raise ProtocolViolation(f"{silo}: {exc}") from None


class KeyPeers:
    """Signers known by their public keys alone (the in-process simulator and tests); credentials unused."""

    def __init__(self, keys: Mapping[str, ec.EllipticCurvePublicKey]) -> None:
        self.keys = dict(keys)

    def verify(self, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str) -> None:
        if silo not in self.keys:
            raise ProtocolViolation(f"no signing key is known for {silo}")
        try:
            verify_key(self.keys[silo], signature, data, context=context, signer=silo)
        except PkiError as exc:
            raise ProtocolViolation(f"{silo}: {exc}") from None
