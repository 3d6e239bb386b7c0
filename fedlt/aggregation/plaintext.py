"""The `plaintext` privacy layer: a float64 sum in the clear, for research and tests only."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from fedlt.aggregation.schema import Contribution, Schema
from fedlt.aggregation.sums import SumLayer, Sums

log = logging.getLogger(__name__)


class PlaintextSum(SumLayer):
    """Adds contributions in silo order; whoever runs it sees every silo's values, so it says so."""

    name = "plaintext"

    def __init__(self) -> None:
        log.warning(
            "privacy layer 'plaintext': contributions are summed in the clear — "
            "whoever aggregates sees each silo's values; for research and tests only"
        )

    def aggregate(
        self, schema: Schema, contributions: Sequence[Contribution], *, silos: Sequence[str] = ()
    ) -> Sums:
        self.check_round(schema, contributions)
        total = torch.zeros(schema.size, dtype=torch.float64)
        for c in contributions:
            total += c.flat()
        return self.seal(schema, total, len(contributions))
