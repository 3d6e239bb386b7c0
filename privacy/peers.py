"""Who signed a message, in every layer: how a silo signs, how its peers check, and the signatures silos send.

Peers are consortium certificates checked against the roster (`ConsortiumPeers`), or bare keys in a
simulation (`KeyPeers`); either refuses a signature it cannot tie to the silo named with `BadSignature`.

The consistency signature travels in one RPC (`Consistency`) for every layer whose silos sign what they were
handed (secagg's consistency round, ckks's signature over the encrypted sum): each such layer's wire lists
`SIGNATURE_SENDERS`, `SIGNATURE_RECEIVERS` and `SIGNATURE_DRILL_NAMES` below (its `LayerWire`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric import ec

from fedlt.aggregation.halves import BadMessage
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import SUM_OF_PURPOSE
from privacy.pki.errors import PkiError
from privacy.pki.identity import MemberTrust
from privacy.pki.signing import verify, verify_key


class BadSignature(BadMessage):
    """A signature that does not verify, or a signer the peers do not know as the silo it claims to be."""


@dataclass(frozen=True)
class ConsistencySignature:
    """A silo's signature over its view of a sum (under secagg: the session, the binding, the key list and
    U3; under ckks: the ciphertext it was handed and the survivors), sent to the aggregator."""

    signature: bytes


@dataclass(frozen=True)
class Signed:
    """One silo's signature, with its certificate (PEM) in a consortium for peers to check."""

    signature: bytes
    certificate: bytes = field(default=b"", repr=False)


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
            raise BadSignature(f"{silo}: {exc}") from None


class KeyPeers:
    """Signers known by their public keys alone (the in-process simulator and tests); credentials unused."""

    def __init__(self, keys: Mapping[str, ec.EllipticCurvePublicKey]) -> None:
        self.keys = dict(keys)

    def verify(self, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str) -> None:
        if silo not in self.keys:
            raise BadSignature(f"no signing key is known for {silo}")
        try:
            verify_key(self.keys[silo], signature, data, context=context, signer=silo)
        except PkiError as exc:
            raise BadSignature(f"{silo}: {exc}") from None


def send_signature(stub, round_id: str, purpose: str, signed: ConsistencySignature, timeout: float) -> object:
    request = pb.ConsistencyRequest(
        round_id=round_id, sum=SUM_OF_PURPOSE[purpose], signature=signed.signature
    )
    return stub.Consistency(request, timeout=timeout)


def received_signature(request: pb.ConsistencyRequest, *_: object) -> ConsistencySignature:
    """The signature alone: its silo is the caller TLS verified, its certificate what the roster pins."""
    return ConsistencySignature(request.signature)


SIGNATURE_SENDERS = {ConsistencySignature: send_signature}
SIGNATURE_RECEIVERS = {"Consistency": received_signature}
SIGNATURE_DRILL_NAMES = {ConsistencySignature: "consistency"}
