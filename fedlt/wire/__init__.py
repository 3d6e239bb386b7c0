"""What every layer's messages share on the wire (fedlt/v1 Protobuf), written once for silo and aggregator.

Schemas, censuses and which sum a message belongs to travel the same way whatever the privacy layer; large
payloads move in `CHUNK`-sized parts, a Submit stream as a header (round, kind, size, SHA-256) and chunks.
A layer's own messages travel either in Protobuf forms of its own (`LayerWire`) or, declared as dataclasses,
through the one generic codec (`codec`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from fedlt.aggregation.round_sums import CensusResult
from fedlt.aggregation.schema import Field, Schema
from fedlt.aggregation.tail_guard import Census
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from fedlt.wire.fields import Mapped

CHUNK = 1 << 20  # bytes per streamed part, both ways

SUM_OF_PURPOSE = {
    "census": pb.SECURE_SUM_CENSUS,
    "contribution": pb.SECURE_SUM_CONTRIBUTION,
    "evaluation": pb.SECURE_SUM_EVALUATION,
}
PURPOSE_OF_SUM = {v: k for k, v in SUM_OF_PURPOSE.items()}


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
