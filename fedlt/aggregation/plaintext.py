"""The `plaintext` privacy layer: a float64 sum in the clear, for research and tests only.

Its halves have one stage: each silo uploads its vector (`Upload`), the aggregator checks it against the
schema and adds the uploads in silo order, in float64. Whoever aggregates sees every silo's values, so the
layer says so, and a silo takes part only if its policy lists it. An upload is each field in its `wire_dtype`
(float32, the model's own precision, except second moments and large counts), little-endian, in schema order:
half the bytes of float64 for a model change. The simulator's halves exchange the same bytes, so its sums are
the consortium's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    PartyKeys,
    Released,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
)
from fedlt.aggregation.registry import LayerRecord, LayerWire
from fedlt.aggregation.schema import Schema
from fedlt.aggregation.sums import SumLayer
from fedlt.errors import ContributionError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import submit_stream

log = logging.getLogger(__name__)

UPLOAD = "upload"


@dataclass(frozen=True)
class Upload:
    """One silo's contribution in the clear: its fields in their wire dtypes, in schema order."""

    payload: bytes = field(repr=False)


def upload_bytes(schema: Schema) -> int:
    return sum(f.size * np.dtype(f.wire_dtype).itemsize for f in schema.fields)


def to_wire(schema: Schema, vector: torch.Tensor) -> bytes:
    values = vector.detach().cpu().numpy()
    parts, start = [], 0
    for f in schema.fields:
        parts.append(np.ascontiguousarray(values[start : start + f.size], dtype=f.wire_dtype).tobytes())
        start += f.size
    return b"".join(parts)


def from_wire(schema: Schema, payload: bytes) -> torch.Tensor:
    """The float64 vector of an upload; one of another length is refused, not cut."""
    expected = upload_bytes(schema)
    if len(payload) != expected:
        raise ContributionError(f"an upload of {len(payload)} bytes; the schema needs {expected}")
    out, start, offset = np.empty(schema.size, dtype=np.float64), 0, 0
    for f in schema.fields:
        values = np.frombuffer(payload, dtype=f.wire_dtype, count=f.size, offset=offset)
        out[start : start + f.size] = values
        start, offset = start + f.size, offset + values.nbytes
    return torch.from_numpy(out)


class PlaintextSiloHalf(SiloHalf):
    def __init__(self, spec: SumSpec) -> None:
        self.spec = spec
        self._sent = False

    def start(self, vector: torch.Tensor) -> list[object]:
        self._sent = True
        return [Upload(to_wire(self.spec.schema, vector))]

    def step(self, step: object) -> list[object]:
        raise SumAborted(f"the plaintext layer has one stage; {type(step).__name__} does not belong to it")

    @property
    def done(self) -> bool:
        return self._sent

    @property
    def counted(self) -> tuple[str, ...]:
        return ()


class PlaintextAggregatorHalf(AggregatorHalf):
    def __init__(self, spec: SumSpec) -> None:
        self.spec = spec
        self._uploads: dict[str, tuple[str, torch.Tensor]] = {}  # silo -> (SHA-256 of its upload, clipped)
        self._closed = False

    @property
    def stage(self) -> str:
        return "done" if self._closed else UPLOAD

    @property
    def expected(self) -> tuple[str, ...]:
        return () if self._closed else self.spec.silos

    @property
    def answered(self) -> set[str]:
        return set(self._uploads)

    def receive(self, silo: str, message: object) -> None:
        if self._closed or silo not in self.spec.silos:
            raise SumAborted(f"{silo} may not upload to this sum now")
        if not isinstance(message, Upload):
            raise SumAborted(f"the plaintext layer takes uploads, not {type(message).__name__}")
        digest = hashlib.sha256(message.payload).hexdigest()
        if silo in self._uploads:
            if self._uploads[silo][0] != digest:
                raise SumAborted(f"{silo} already uploaded other values")
            return
        schema = self.spec.schema
        # non-finite values are refused here, values beyond a field's bound clipped (as an honest silo's are)
        checked = schema.contribution(**schema.unflatten(from_wire(schema, message.payload)))
        self._uploads[silo] = digest, checked.flat()

    def close(self) -> Mapping[str, object] | Released:
        self._closed = True
        survivors = tuple(u for u in self.spec.silos if u in self._uploads)
        total = torch.zeros(self.spec.schema.size, dtype=torch.float64)
        for u in survivors:
            total += self._uploads[u][1]
        return Released(survivors, total)

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not Upload or self._closed:
            raise SumAborted(f"this sum takes plaintext uploads before it closes, not a {kind.__name__}")
        return upload_bytes(self.spec.schema)


class PlaintextSiloSide(SiloSide):
    """The plaintext layer needs no keys; nothing is released that the upload did not already give away."""

    hides_inputs = False

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        return PlaintextSiloHalf(spec)

    def min_counted(self, spec: SumSpec) -> int:
        """DP noise as if every listed silo's share is in the sum: research runs, where the aggregator sees
        each upload anyway, compare with the secure layers at full participation."""
        return len(spec.silos)


class PlaintextAggregatorSide(AggregatorSide):
    def half(self, spec: SumSpec) -> AggregatorHalf:
        return PlaintextAggregatorHalf(spec)


class PlaintextSum(SumLayer):
    """Adds contributions in silo order; whoever runs it sees every silo's values, so it says so."""

    name = "plaintext"

    def __init__(self) -> None:
        super().__init__()
        log.warning(
            "privacy layer 'plaintext': contributions are summed in the clear — "
            "whoever aggregates sees each silo's values; for research and tests only"
        )

    def describe(self) -> str:
        return "plaintext (the aggregator sees every silo's contribution)"

    def silo_side(self, keys: PartyKeys[None, None]) -> SiloSide:
        return PlaintextSiloSide()

    def aggregator_side(self, keys: PartyKeys[None, None]) -> AggregatorSide:
        return PlaintextAggregatorSide()

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        return dict.fromkeys(silos, PlaintextSiloSide()), PlaintextAggregatorSide()


def _submit(stub, round_id: str, purpose: str, upload: Upload, timeout: float) -> object:
    stream = submit_stream(round_id, upload.payload, kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose=purpose)
    return stub.Submit(stream, timeout=timeout)


LAYER = LayerRecord(
    name="plaintext",
    layer=PlaintextSum,
    wire=LayerWire(
        senders={Upload: _submit},
        uploads={pb.CONTRIBUTION_KIND_PLAINTEXT: (Upload, Upload)},
        payloads={Upload: (pb.CONTRIBUTION_KIND_PLAINTEXT, lambda upload: upload.payload)},
    ),
)
