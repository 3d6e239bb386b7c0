"""Who signed a secure-aggregation message: consortium certificates, or bare keys in a simulation."""

from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric import ec

from privacy.pki.errors import PkiError
from privacy.pki.identity import load_certificate, silo_id_of, verify_chain
from privacy.pki.signing import verify, verify_key
from privacy.secagg.protocol import ProtocolViolation


class ConsortiumPeers:
    """A credential is the signer's certificate: issued by the consortium CA and naming the claimed silo.

    Revocation is the aggregator's to enforce (it holds the revocation list and refuses revoked callers);
    a silo checks that a peer's keys come from a consortium member under the name the aggregator gives.
    """

    def __init__(self, ca_pem: bytes) -> None:
        self.ca = load_certificate(ca_pem, source="the consortium CA certificate")
        self._checked: dict[bytes, object] = {}

    def verify(self, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str) -> None:
        try:
            cert = self._checked.get(credential)
            if cert is None:
                cert = load_certificate(credential, source=f"the certificate sent for {silo}")
                verify_chain(cert, self.ca)
                self._checked[credential] = cert
            if silo_id_of(cert) != silo:
                raise PkiError(f"the certificate sent for {silo} belongs to {silo_id_of(cert)}")
            verify(cert, signature, data, context=context)
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
