"""Every implemented layer's messages on the consortium's wire, looked up by message type, not layer name.

The silo agent sends whatever its layer half produced (`send`) and reads each `SumStep` back into the step its
half expects (`step_from_pb`); the aggregator turns each stage output into a `SumStep` (`step_to_pb`) and a
Submit stream's kind into the upload it carries (`UPLOADS`, `submitted`, with what the stream's header adds to
it: `FROM_HEADER`). A new layer adds its entries to these tables.
"""

from __future__ import annotations

from collections.abc import Callable

from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.plaintext import Upload
from fedlt.aggregation.round_sums import CensusResult
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import (
    PURPOSE_OF_SUM,
    SUM_OF_PURPOSE,
    census_result_from_pb,
    census_result_to_pb,
    submit_stream,
    upload_of,
    upload_payload,
)
from privacy.ckks import wire as ckks
from privacy.ckks.halves import EncryptedUpload
from privacy.secagg import wire as secagg
from privacy.secagg.protocol import MaskedInput


def _submit_upload(stub, round_id: str, purpose: str, upload: Upload, timeout: float) -> object:
    stream = submit_stream(
        round_id, upload_payload(upload), kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose=purpose
    )
    return stub.Submit(stream, timeout=timeout)


SENDERS: dict[type, secagg.Send] = {Upload: _submit_upload, **secagg.SENDERS, **ckks.SENDERS}
STEP_ENCODERS: dict[type, Callable[[object], dict[str, object]]] = {
    CensusResult: lambda result: {"census": census_result_to_pb(result)},
    **secagg.STEP_ENCODERS,
    **ckks.STEP_ENCODERS,
}
STEP_DECODERS: dict[str, Callable[[pb.SumStep], object]] = {
    "census": lambda step: census_result_from_pb(step.census),
    **secagg.STEP_DECODERS,
    **ckks.STEP_DECODERS,
}
# a Submit stream's kind: the upload message it carries, and how to read it from the payload
UPLOADS: dict[int, tuple[type, Callable[[bytes], object]]] = {
    pb.CONTRIBUTION_KIND_PLAINTEXT: (Upload, upload_of),
    pb.CONTRIBUTION_KIND_MASKED: (MaskedInput, secagg.masked_of),
    pb.CONTRIBUTION_KIND_CKKS: (EncryptedUpload, EncryptedUpload),
}
# uploads whose Submit header carries part of the message (a census's masked input: its signature)
FROM_HEADER: dict[type, Callable[[object, pb.SubmitHeader], object]] = {MaskedInput: secagg.signed_by_header}
# steps that only announce a payload the silo then downloads: (stub, round_id, purpose, step, timeout) -> step
FETCHERS: dict[type, Callable[..., object]] = dict(ckks.FETCHERS)
RECEIVERS: dict[str, Callable[[object, str, bytes], object]] = dict(secagg.RECEIVERS)
DRILL_NAMES: dict[type, str] = dict(secagg.DRILL_NAMES)


# The layers whose every message these tables carry: what a consortium may run and a silo may accept.
CONSORTIUM_LAYERS = ("plaintext", "secagg", "ckks")


class WireError(ValueError):
    """A message or step of a type no implemented layer carries."""


class BadStep(WireError, BadMessage):
    """A SumStep from the aggregator that carries no step, or names no sum: a broken protocol message, which
    the silo refuses as it refuses any other (a FedltError), leaving the round's sums and going on."""


def send(stub, round_id: str, purpose: str, message: object, *, timeout: float) -> object:
    sender = SENDERS.get(type(message))
    if sender is None:
        raise WireError(f"no RPC carries a {type(message).__name__}")
    return sender(stub, round_id, purpose, message, timeout)


def received(rpc: str, request: object, *, silo: str, credential: bytes) -> object:
    """The message a layer's RPC request carries; `silo` and `credential` come from the transport."""
    return RECEIVERS[rpc](request, silo, credential)


# an upload sent inside another message (a state report's evaluation counts): its kind and its bytes
PAYLOADS: dict[type, tuple[int, Callable[[object], bytes]]] = {
    Upload: (pb.CONTRIBUTION_KIND_PLAINTEXT, upload_payload),
    EncryptedUpload: (pb.CONTRIBUTION_KIND_CKKS, lambda upload: upload.blob),
}


def payload_of(upload: object) -> tuple[int, bytes]:
    if type(upload) not in PAYLOADS:
        raise WireError(f"a {type(upload).__name__} does not travel inside another message")
    kind, encode = PAYLOADS[type(upload)]
    return kind, encode(upload)


def upload_of(kind: int, payload: bytes) -> object:
    """The upload a payload of `kind` carries."""
    return UPLOADS[kind][1](payload)


def submitted(header: pb.SubmitHeader, payload: bytes) -> object:
    """The upload a Submit stream carries: its payload read by its kind, with what the header adds."""
    upload = upload_of(header.kind, payload)
    from_header = FROM_HEADER.get(type(upload))
    return upload if from_header is None else from_header(upload, header)


def step_to_pb(round_id: str, purpose: str, step: object) -> pb.SumStep:
    encoder = STEP_ENCODERS.get(type(step))
    if encoder is None:
        raise WireError(f"no SumStep carries a {type(step).__name__}")
    return pb.SumStep(round_id=round_id, sum=SUM_OF_PURPOSE[purpose], **encoder(step))


def fetched(stub, round_id: str, purpose: str, step: object, *, timeout: float) -> object:
    """The step itself, or the payload it announces, downloaded and checked."""
    fetcher = FETCHERS.get(type(step))
    return step if fetcher is None else fetcher(stub, round_id, purpose, step, timeout)


def step_from_pb(step: pb.SumStep) -> tuple[str, object]:
    """(purpose, step); an empty or unknown step, or one naming no sum, is a BadStep."""
    kind = step.WhichOneof("step")
    if kind not in STEP_DECODERS or step.sum not in PURPOSE_OF_SUM:
        raise BadStep(f"a SumStep with step {kind!r} for sum {step.sum}")
    return PURPOSE_OF_SUM[step.sum], STEP_DECODERS[kind](step)
