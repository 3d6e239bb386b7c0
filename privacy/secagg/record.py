"""The `secagg` layer's record in the registry (`fedlt.aggregation.registry`): its sum, settings, RoundSpec
parameters and messages."""

from __future__ import annotations

from dataclasses import asdict
from fractions import Fraction

from fedlt.aggregation.registry import LayerRecord, RoundParameters
from fedlt.v1 import round_pb2
from privacy.secagg import wire
from privacy.secagg.layer import SecAggSum
from privacy.secagg.policy import SessionPolicy
from privacy.secagg.settings import SecAggSettings


def _read(spec: round_pb2.RoundSpec) -> SecAggSettings:
    return SecAggSettings(
        threshold=spec.secagg.threshold,
        neighbours=spec.secagg.neighbours,
        k_min=spec.secagg.k_min,
        min_records=spec.secagg.min_records,
    )


def _policy(section) -> SessionPolicy:
    """A silo's minimums for secure sums, from its [policy] section."""
    return SessionPolicy(
        min_participants=section.min_participants,
        threshold_above=Fraction(section.threshold_above),
        min_neighbours=section.min_neighbours,
    )


LAYER = LayerRecord(
    name="secagg",
    layer=SecAggSum,
    settings=SecAggSettings,
    parameters=RoundParameters(
        write=lambda settings: {"secagg": round_pb2.SecAggParameters(**asdict(settings))}, read=_read
    ),
    wire=wire.WIRE,
    policy=_policy,
)
