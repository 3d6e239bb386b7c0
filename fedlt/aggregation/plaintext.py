"""The `plaintext` privacy layer: a float64 sum in the clear, for research and tests only.

Its halves have one stage: each silo uploads its vector as it is (`Upload`), the aggregator checks it against
the schema and adds the uploads in silo order. Whoever aggregates sees every silo's values, so the layer says
so, and a silo takes part only if its policy lists it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
from fedlt.aggregation.sums import SumLayer
from fedlt.errors import ContributionError

log = logging.getLogger(__name__)

UPLOAD = "upload"


@dataclass(frozen=True)
class Upload:
    """One silo's contribution in the clear, float64 in schema order."""

    vector: torch.Tensor


class PlaintextSiloHalf(SiloHalf):
    def __init__(self, spec: SumSpec) -> None:
        self.spec = spec
        self._sent = False

    def start(self, vector: torch.Tensor) -> list[object]:
        self._sent = True
        return [Upload(vector.to(torch.float64))]

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
        self._uploads: dict[str, torch.Tensor] = {}
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
        vector = message.vector
        if silo in self._uploads:
            if not torch.equal(self._uploads[silo], vector):
                raise SumAborted(f"{silo} already uploaded other values")
            return
        schema = self.spec.schema
        if vector.shape != (schema.size,):
            raise ContributionError(f"an upload of {vector.numel()} values; the schema needs {schema.size}")
        schema.contribution(**schema.unflatten(vector))  # non-finite values, wrong shapes: refused here
        self._uploads[silo] = vector

    def close(self) -> Mapping[str, object] | Released:
        self._closed = True
        survivors = tuple(u for u in self.spec.silos if u in self._uploads)
        total = torch.zeros(self.spec.schema.size, dtype=torch.float64)
        for u in survivors:
            total += self._uploads[u]
        return Released(survivors, total)

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not Upload or self._closed:
            raise SumAborted(f"this sum takes plaintext uploads before it closes, not a {kind.__name__}")
        return self.spec.schema.size * 8


class PlaintextSiloSide(SiloSide):
    """The plaintext layer needs no keys; nothing is released that the upload did not already give away."""

    hides_inputs = False

    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        return PlaintextSiloHalf(spec)


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

    def silo_side(self, keys: PartyKeys) -> SiloSide:
        return PlaintextSiloSide()

    def aggregator_side(self, keys: PartyKeys) -> AggregatorSide:
        return PlaintextAggregatorSide()

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        return dict.fromkeys(silos, PlaintextSiloSide()), PlaintextAggregatorSide()
