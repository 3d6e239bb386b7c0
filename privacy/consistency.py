"""The consistency signature on the wire: one RPC (`Consistency`) for every layer whose silos sign what they
were handed (secagg's consistency round, ckks's signature over the encrypted sum). Each such layer's record
lists these entries (`fedlt.aggregation.registry.LayerWire`); the registry merges them once."""

from __future__ import annotations

from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import SUM_OF_PURPOSE
from privacy.peers import ConsistencySignature


def send_signature(stub, round_id: str, purpose: str, signed: ConsistencySignature, timeout: float) -> object:
    request = pb.ConsistencyRequest(
        round_id=round_id, sum=SUM_OF_PURPOSE[purpose], signature=signed.signature
    )
    return stub.Consistency(request, timeout=timeout)


def received_signature(request: pb.ConsistencyRequest, *_: object) -> ConsistencySignature:
    """The signature alone: its silo is the caller TLS verified, its certificate what the roster pins."""
    return ConsistencySignature(request.signature)


SENDERS = {ConsistencySignature: send_signature}
RECEIVERS = {"Consistency": received_signature}
DRILL_NAMES = {ConsistencySignature: "consistency"}
