"""Every installed layer's messages on the consortium's wire, by message type, not by layer name.

The tables merge the registry's records (`fedlt.aggregation.registry`): a layer's messages in Protobuf forms
of its own (`LayerWire`), or its dataclass messages, which the one generic codec carries (`fedlt.wire.codec`):
a silo's upload as a Submit stream of kind LAYER, any other silo message through the Send RPC, and the
aggregator's stage outputs in a SumStep's `layer` field. The silo agent sends whatever its layer half produced
(`send`) and reads each `SumStep` back into the step its half expects (`step_from_pb`); the aggregator turns
each stage output into a `SumStep` (`step_to_pb`) and a Submit stream into the upload it carries
(`upload_type`, `submitted`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache

from google.protobuf.message import DecodeError

from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.registry import LayerRecord, RegistryError, layers, record
from fedlt.aggregation.round_sums import CensusResult
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import layer_pb2
from fedlt.wire import (
    PURPOSE_OF_SUM,
    SUM_OF_PURPOSE,
    census_result_from_pb,
    census_result_to_pb,
    submit_stream,
)
from fedlt.wire.codec import BadLayerMessage, WireError, check_carried, decode, encode

__all__ = ["BadStep", "WireError"]


# the RPCs through which a silo sends a stage message of a sum: a layer's receivers take only these
STAGE_RPCS = tuple(
    m.name
    for m in pb.DESCRIPTOR.services_by_name["ConsortiumService"].methods
    if {"round_id", "sum"} <= set(m.input_type.fields_by_name)
)


class BadStep(WireError, BadMessage):
    """A SumStep from the aggregator that carries no step, or names no sum: a broken protocol message, which
    the silo refuses as it refuses any other (a FedltError), leaving the round's sums and going on."""


@dataclass
class Tables:
    senders: dict[type, Callable[..., object]] = field(default_factory=dict)
    step_encoders: dict[type, Callable[[object], dict[str, object]]] = field(default_factory=dict)
    step_decoders: dict[str, Callable[[pb.SumStep], object]] = field(default_factory=dict)
    uploads: dict[int, tuple[type, Callable[[bytes], object]]] = field(default_factory=dict)
    from_header: dict[type, Callable[[object, pb.SubmitHeader], object]] = field(default_factory=dict)
    fetchers: dict[type, Callable[..., object]] = field(default_factory=dict)
    receivers: dict[str, Callable[[object, str, bytes], object]] = field(default_factory=dict)
    drill_names: dict[type, str] = field(default_factory=dict)
    payloads: dict[type, tuple[int, Callable[[object], bytes]]] = field(default_factory=dict)
    generic: dict[str, type] = field(default_factory=dict)  # the codec's type names -> dataclasses
    generic_uploads: set[type] = field(default_factory=set)

    def unary(self) -> dict[str, type]:
        """The dataclass messages the Send RPC carries: all but the uploads."""
        return {name: cls for name, cls in self.generic.items() if cls not in self.generic_uploads}

    def merge(self, name: str, table: str, entries: Mapping) -> None:
        """Add a record's entries; one key carried two ways by two layers is a broken registry."""
        mine = getattr(self, table)
        for key, value in entries.items():
            if mine.setdefault(key, value) is not value:
                raise RegistryError(f"layer {name}: {key!r} is carried by another installed layer already")


@cache
def tables(layer: str | None = None) -> Tables:
    """The tables of one layer, by which everything a round's parties receive is read (a message of a layer
    the round does not run is refused before any of that layer's code runs), or, None, of every installed
    layer (what the service serves, what the agent sends)."""
    merged = Tables(
        step_decoders={
            "census": lambda step: census_result_from_pb(step.census),
            "layer": lambda step: decode(step.layer, merged.generic),
        },
        # the Send RPC carries a layer's dataclass messages, except its uploads: those travel as Submit
        # streams, whose size the sum's half bounds before a byte is read, and which the audit records
        receivers={"Send": lambda request, *_: decode(request.message, merged.unary())},
    )
    merged.step_encoders[CensusResult] = lambda result: {"census": census_result_to_pb(result)}
    for installed in layers().values() if layer is None else (record(layer),):
        _add(merged, installed)
    return merged


def _add(merged: Tables, record: LayerRecord) -> None:
    unknown = sorted(set(record.wire.receivers) - set(STAGE_RPCS))
    if unknown:
        raise RegistryError(f"layer {record.name}: {unknown[0]} is no stage RPC of the consortium's service")
    for cls in record.messages:
        try:
            check_carried(cls)
        except WireError as exc:
            raise RegistryError(f"layer {record.name}: {exc}") from None
    wire = record.wire
    for table in ("senders", "step_encoders", "step_decoders", "uploads", "from_header", "fetchers"):
        merged.merge(record.name, table, getattr(wire, table))
    for table in ("receivers", "drill_names", "payloads"):
        merged.merge(record.name, table, getattr(wire, table))
    generic = record.message_types()
    merged.merge(record.name, "generic", generic)
    for name, cls in generic.items():
        merged.merge(
            record.name, "senders", {cls: _upload_sender(name) if cls in record.uploads else _sender(name)}
        )
        merged.merge(record.name, "step_encoders", {cls: _step_encoder(name)})
        merged.merge(record.name, "payloads", {cls: (pb.CONTRIBUTION_KIND_LAYER, _payload_encoder(name))})
    merged.generic_uploads |= set(record.uploads)


def _sender(name: str) -> Callable[..., object]:
    def send_one(stub, round_id: str, purpose: str, message: object, timeout: float) -> object:
        request = pb.SendRequest(
            round_id=round_id, sum=SUM_OF_PURPOSE[purpose], message=encode(message, name)
        )
        return stub.Send(request, timeout=timeout)

    return send_one


def _upload_sender(name: str) -> Callable[..., object]:
    def submit(stub, round_id: str, purpose: str, message: object, timeout: float) -> object:
        payload = encode(message, name).SerializeToString(deterministic=True)
        stream = submit_stream(
            round_id, payload, kind=pb.CONTRIBUTION_KIND_LAYER, purpose=purpose, message_type=name
        )
        return stub.Submit(stream, timeout=timeout)

    return submit


def _step_encoder(name: str) -> Callable[[object], dict[str, object]]:
    return lambda step: {"layer": encode(step, name)}


def _payload_encoder(name: str) -> Callable[[object], bytes]:
    return lambda message: encode(message, name).SerializeToString(deterministic=True)


def consortium_layers() -> tuple[str, ...]:
    """The layers a consortium may run and a silo may accept: every installed one."""
    return tuple(layers())


def upload_types() -> frozenset[type]:
    """Every message a silo sends as an upload (a Submit stream)."""
    merged = tables()
    return frozenset({kind for kind, _ in merged.uploads.values()} | merged.generic_uploads)


def drill_name(message: object) -> str | None:
    """What dropout drills call this message (None: no drill stops at it)."""
    return tables().drill_names.get(type(message))


def send(stub, round_id: str, purpose: str, message: object, *, timeout: float) -> object:
    sender = tables().senders.get(type(message))
    if sender is None:
        raise WireError(f"no RPC carries a {type(message).__name__}")
    return sender(stub, round_id, purpose, message, timeout)


def receivers() -> dict[str, Callable[[object, str, bytes], object]]:
    """The stage RPCs, by name: each reads its request into a layer's message."""
    return tables().receivers


def received(rpc: str, request: object, *, silo: str, credential: bytes, layer: str) -> object:
    """The message a layer's RPC request carries, read as a message of `layer` (the consortium's); `silo`
    and `credential` come from the transport."""
    receiver = tables(layer).receivers.get(rpc)
    if receiver is None:
        raise BadLayerMessage(f"the {layer} layer takes nothing through {rpc}")
    return receiver(request, silo, credential)


def payload_of(upload: object) -> tuple[int, bytes]:
    """An upload sent inside another message (a state report's evaluation counts): its kind and bytes."""
    payloads = tables().payloads
    if type(upload) not in payloads:
        raise WireError(f"a {type(upload).__name__} does not travel inside another message")
    kind, encode_payload = payloads[type(upload)]
    return kind, encode_payload(upload)


def upload_of(kind: int, payload: bytes, message_type: str = "", *, layer: str) -> object:
    """The upload a payload of `kind` carries, as an upload of `layer` (of kind LAYER: the LayerMessage it
    holds, which must be one of the layer's uploads, of the type announced if one was)."""
    merged = tables(layer)
    if kind == pb.CONTRIBUTION_KIND_LAYER:
        try:
            message = layer_pb2.LayerMessage.FromString(payload)
        except DecodeError:
            raise BadLayerMessage("an upload that is no LayerMessage") from None
        if message_type and message.type != message_type:
            raise BadLayerMessage(
                f"an upload announced as {message_type[:64]!r} holds a {message.type[:64]!r}"
            )
        uploads = {n: c for n, c in merged.generic.items() if c in merged.generic_uploads}
        return decode(message, uploads)
    uploads = merged.uploads
    if kind not in uploads:
        raise WireError(f"a payload of kind {kind} carries no upload")
    return uploads[kind][1](payload)


def payload_kinds() -> frozenset[int]:
    """The kinds of payload that carry a layer's upload (a Submit stream's, a state report's)."""
    merged = tables()
    return frozenset(merged.uploads) | ({pb.CONTRIBUTION_KIND_LAYER} if merged.generic else frozenset())


def upload_type(header: pb.SubmitHeader, *, layer: str) -> type:
    """The message type a Submit stream announces, as an upload of `layer`, before a byte of its payload
    is read."""
    merged = tables(layer)
    if header.kind == pb.CONTRIBUTION_KIND_LAYER:
        cls = merged.generic.get(header.message_type)
        if cls is None or cls not in merged.generic_uploads:
            raise WireError(f"message_type {header.message_type[:64]!r} is no upload of an installed layer")
        return cls
    if header.kind not in merged.uploads:
        raise WireError(f"kind {header.kind} carries no upload")
    return merged.uploads[header.kind][0]


def submitted(header: pb.SubmitHeader, payload: bytes, *, layer: str) -> object:
    """The upload a Submit stream carries, as an upload of `layer`: its payload read by its kind, with what
    the header adds."""
    upload = upload_of(header.kind, payload, header.message_type, layer=layer)
    from_header = tables(layer).from_header.get(type(upload))
    return upload if from_header is None else from_header(upload, header)


def step_to_pb(round_id: str, purpose: str, step: object) -> pb.SumStep:
    encoder = tables().step_encoders.get(type(step))
    if encoder is None:
        raise WireError(f"no SumStep carries a {type(step).__name__}")
    return pb.SumStep(round_id=round_id, sum=SUM_OF_PURPOSE[purpose], **encoder(step))


def fetched(stub, round_id: str, purpose: str, step: object, *, timeout: float) -> object:
    """The step itself, or the payload it announces, downloaded and checked."""
    fetcher = tables().fetchers.get(type(step))
    return step if fetcher is None else fetcher(stub, round_id, purpose, step, timeout)


def step_from_pb(step: pb.SumStep, *, layer: str) -> tuple[str, object]:
    """(purpose, step), read as a step of `layer` (the round's); an empty step, one of another layer, or
    one naming no sum, is a BadStep."""
    kind = step.WhichOneof("step")
    decoders = tables(layer).step_decoders
    if kind not in decoders or step.sum not in PURPOSE_OF_SUM:
        raise BadStep(f"a SumStep with step {kind!r} for sum {step.sum}")
    return PURPOSE_OF_SUM[step.sum], decoders[kind](step)
