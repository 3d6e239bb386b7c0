"""The `ckks` layer's messages in their Protobuf form (fedlt/v1), for silo and aggregator.

An encrypted upload is a Submit stream of kind CKKS. The encrypted sum is too large for the directive stream,
so its `SumStep` only announces it (`SumReady`: who it counts, its size and SHA-256) and the silo fetches it
through the FetchSum RPC (`fetch_sum`), reading no more than announced and checking the hash before it signs
anything. A silo's consistency signature goes out through the Consistency RPC as secagg's does
(`privacy.peers`); the survivors' signatures come back in one `SumStep`, each with the certificate its
silo enrolled with. The key ceremony's messages are the key service's (`privacy.keyservice.wire`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.registry import LayerWire
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import fetch_announced, submit_stream
from privacy.ckks.halves import EncryptedSum, EncryptedUpload, SumSignatures
from privacy.peers import SIGNATURE_DRILL_NAMES, SIGNATURE_RECEIVERS, SIGNATURE_SENDERS, Signed


@dataclass(frozen=True)
class SumReady:
    """A SumStep's announcement of an encrypted sum, before the silo has fetched it."""

    survivors: tuple[str, ...]
    total_bytes: int
    sha256: str


def _submit_encrypted(stub, round_id: str, purpose: str, upload: EncryptedUpload, timeout: float) -> object:
    stream = submit_stream(round_id, upload.blob, kind=pb.CONTRIBUTION_KIND_CKKS, purpose=purpose)
    return stub.Submit(stream, timeout=timeout)


def ready_to_pb(step: EncryptedSum) -> dict[str, object]:
    announced = pb.EncryptedSumReady(
        survivors=step.survivors, total_bytes=len(step.blob), sha256=hashlib.sha256(step.blob).hexdigest()
    )
    return {"encrypted_sum": announced}


def ready_from_pb(step: pb.SumStep) -> SumReady:
    ready = step.encrypted_sum
    return SumReady(tuple(ready.survivors), ready.total_bytes, ready.sha256)


def fetch_sum(stub, round_id: str, purpose: str, ready: SumReady, timeout: float) -> EncryptedSum:
    data = fetch_announced(
        stub, round_id, purpose, total_bytes=ready.total_bytes, sha256=ready.sha256, timeout=timeout
    )
    return EncryptedSum(data, ready.survivors)


def signatures_to_pb(step: SumSignatures) -> dict[str, object]:
    signatures = [
        pb.CkksSiloSignature(silo_id=silo, signature=signed.signature, certificate=signed.certificate)
        for silo, signed in sorted(step.by_silo.items())
    ]
    return {"ckks_signatures": pb.CkksSumSignatures(signatures=signatures)}


def signatures_from_pb(step: pb.SumStep) -> SumSignatures:
    signatures = step.ckks_signatures.signatures
    by_silo = {s.silo_id: Signed(s.signature, s.certificate) for s in signatures}
    if len(by_silo) != len(signatures):
        raise BadMessage("a silo's consistency signature listed twice")
    return SumSignatures(by_silo)


WIRE = LayerWire(
    senders={EncryptedUpload: _submit_encrypted, **SIGNATURE_SENDERS},
    step_encoders={EncryptedSum: ready_to_pb, SumSignatures: signatures_to_pb},
    step_decoders={"encrypted_sum": ready_from_pb, "ckks_signatures": signatures_from_pb},
    uploads={pb.CONTRIBUTION_KIND_CKKS: (EncryptedUpload, EncryptedUpload)},
    fetchers={SumReady: fetch_sum},
    receivers=SIGNATURE_RECEIVERS,
    drill_names=SIGNATURE_DRILL_NAMES,
    # an upload sent inside another message (a state report's evaluation counts)
    payloads={EncryptedUpload: (pb.CONTRIBUTION_KIND_CKKS, lambda upload: upload.blob)},
)
