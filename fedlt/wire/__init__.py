"""What every layer's messages share on the wire (fedlt/v1 Protobuf), written once for silo and aggregator.

Schemas, censuses and which sum a message belongs to travel the same way whatever the privacy layer; large
payloads move in `CHUNK`-sized parts, a Submit stream as a header (round, kind, size, SHA-256) and chunks.
A layer's own messages travel either in Protobuf forms of its own (`LayerWire`) or, declared as dataclasses,
through the one generic codec (`codec`).

One way maps a dataclass to its Protobuf message and back (`Mapped`): field by field, by name.

Messages that have Protobuf forms of their own (the schema every RoundSpec carries, secagg's keys and share
envelopes, the key service's enrollments and envelopes) are dataclasses whose fields match their messages'
by name, or by the renames given once beside the pair; no module copies fields by hand. Every field of the
dataclass must be carried, unless named `local` (a field that never travels, such as a field's doc).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import Message

from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.round_sums import CensusResult
from fedlt.aggregation.schema import Field, Schema
from fedlt.aggregation.tail_guard import Census
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2

CHUNK = 1 << 20  # bytes per streamed part, both ways

SUM_OF_PURPOSE = {
    "census": pb.SECURE_SUM_CENSUS,
    "contribution": pb.SECURE_SUM_CONTRIBUTION,
    "evaluation": pb.SECURE_SUM_EVALUATION,
}
PURPOSE_OF_SUM = {v: k for k, v in SUM_OF_PURPOSE.items()}


@dataclass(frozen=True)
class Mapped:
    """The dataclass `cls` as the message `message`; `renamed`: dataclass field -> message field."""

    cls: type
    message: type[Message]
    renamed: Mapping[str, str] = field(default_factory=dict)
    local: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        carried = set(self.message.DESCRIPTOR.fields_by_name)
        lost = [name for name in self._fields() if self._on_wire(name) not in carried]
        if lost:
            raise TypeError(f"{self.message.__name__} carries no field for {self.cls.__name__}.{lost[0]}")

    def _fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.cls) if f.init and f.name not in self.local]

    def _on_wire(self, name: str) -> str:
        return self.renamed.get(name, name)

    def to_pb(self, obj: object) -> Message:
        return self.message(**{self._on_wire(name): getattr(obj, name) for name in self._fields()})

    def from_pb(self, message: Message) -> object:
        wire = self.message.DESCRIPTOR.fields_by_name
        values = {}
        for name in self._fields():
            value = getattr(message, self._on_wire(name))
            values[name] = tuple(value) if wire[self._on_wire(name)].is_repeated else value
        return self.cls(**values)


FIELD = Mapped(Field, round_pb2.FieldSpec, local=("doc",))


def schema_to_pb(schema: Schema) -> round_pb2.Schema:
    return round_pb2.Schema(phase=schema.phase, fields=[FIELD.to_pb(f) for f in schema.fields])


def schema_from_pb(schema: round_pb2.Schema) -> Schema:
    return Schema(tuple(FIELD.from_pb(f) for f in schema.fields), phase=schema.phase)


def census_to_pb(census: Census) -> round_pb2.Census:
    return round_pb2.Census(
        silos=census.silos, silos_per_class=census.counts, records_per_class=census.records
    )


def census_from_pb(spec: round_pb2.RoundSpec) -> Census | None:
    if not spec.HasField("census"):
        return None
    return Census.of(spec.census.silos, spec.census.silos_per_class, spec.census.records_per_class)


def census_result_to_pb(result: CensusResult) -> pb.CensusResult:
    return pb.CensusResult(silos_per_class=result.counts or ())


def census_result_from_pb(result: pb.CensusResult) -> CensusResult:
    return CensusResult(tuple(result.silos_per_class) or None)


def chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, part) for a payload streamed in `CHUNK`s."""
    for offset in range(0, len(data), CHUNK):
        yield offset, data[offset : offset + CHUNK]


def submit_stream(
    round_id: str, payload: bytes, *, kind: int, purpose: str = "", message_type: str = ""
) -> Iterator[pb.SubmitRequest]:
    header = pb.SubmitHeader(
        round_id=round_id,
        kind=kind,
        total_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        sum=SUM_OF_PURPOSE.get(purpose, pb.SECURE_SUM_UNSPECIFIED),
        message_type=message_type,
    )
    yield pb.SubmitRequest(header=header)
    for _, part in chunks(payload):
        yield pb.SubmitRequest(chunk=part)


def fetch_announced(
    stub, round_id: str, purpose: str, *, total_bytes: int, sha256: str, timeout: float
) -> bytes:
    """A sum's payload a SumStep announced (its size and SHA-256), through the FetchSum RPC: read no further
    than announced, and refused (BadMessage) unless it is the payload announced."""
    request = pb.FetchSumRequest(round_id=round_id, sum=SUM_OF_PURPOSE[purpose])
    data = bytearray()
    for part in stub.FetchSum(request, timeout=timeout):
        if part.offset != len(data) or len(data) + len(part.data) > total_bytes:
            raise BadMessage(f"the {purpose} sum streamed does not fit the size announced")
        data += part.data
    if len(data) != total_bytes or hashlib.sha256(data).hexdigest() != sha256:
        raise BadMessage(f"the {purpose} sum fetched is not the one announced")
    return bytes(data)
