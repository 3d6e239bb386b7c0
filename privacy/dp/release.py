"""Distributed noise on the statistics a round releases: each silo adds its share of Skellam noise to every
field with a sensitivity, on an integer grid, so that the sum secure aggregation (or CKKS) reveals carries the
target noise once any `counted` silos' shares are in it.

Target: at the sum, per coordinate, a standard deviation of `multiplier` × the field's per-record L2
sensitivity Δ (as DP-SGD's σ is to its clip norm). Each field is noised on its own grid of 2^−g, g chosen so
that Δ spans about 2^16 grid units, never finer than the field's fixed-point grid: fine enough that rounding
adds little to the sensitivity (at most √d units, as a silo rounds its sum of records), coarse enough that
the Poisson means stay far inside int64. A silo rounds its own values to the grid before adding noise, so the
codec encodes them exactly. The release's RDP is the sum over noised fields of the Skellam bound
(`skellam_rdp`) for the rounded sensitivity of one record's row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedlt.aggregation.schema import Field, Schema
from privacy.dp.accountant import ORDERS
from privacy.dp.noise import SecureRandom
from privacy.dp.skellam import SkellamShare, l2_to_l1, rounded_l2, skellam_rdp

SENSITIVITY_UNITS_BITS = 16


def grid_bits(f: Field) -> int:
    """g: the field is noised in units of 2^−g, with Δ·2^g ≈ 2^16 (at most the field's own frac_bits)."""
    return min(f.frac_bits, SENSITIVITY_UNITS_BITS - math.floor(math.log2(f.sensitivity)))


@dataclass(frozen=True)
class FieldNoise:
    """One field's noise at the sum, in grid units: target variance, and one record's L1 / L2 reach."""

    field: Field
    bits: int
    variance: float
    l1: float
    l2: float

    @classmethod
    def of(cls, f: Field, multiplier: float) -> FieldNoise:
        bits = grid_bits(f)
        units = f.sensitivity * 2.0**bits
        # a silo rounds the sum of its records, so one record moves the rounded row by up to ‖x‖ + √d units
        # (`rounded_l2`'s √d/2 holds only for a record rounded on its own)
        l2 = rounded_l2(units, f.row_size) + math.sqrt(f.row_size) / 2
        return cls(f, bits, (multiplier * units) ** 2, l2_to_l1(l2, f.row_size), l2)

    def rdp(self) -> np.ndarray:
        return skellam_rdp(l1=self.l1, l2=self.l2, variance=self.variance)


def noised_fields(fields: Sequence[Field], multiplier: float) -> list[FieldNoise]:
    return [FieldNoise.of(f, multiplier) for f in fields if f.sensitivity > 0]


def release_rdp(fields: Sequence[Field], multiplier: float) -> np.ndarray:
    """The RDP of one release of `fields` whose sum carries the target noise (what `counted` silos give)."""
    total = np.zeros(len(ORDERS))
    for noise in noised_fields(fields, multiplier):
        total += noise.rdp()
    return total


def add_shares(
    schema: Schema,
    vector: torch.Tensor,
    *,
    multiplier: float,
    counted: int,
    participants: int,
    rng: SecureRandom,
) -> torch.Tensor:
    """`vector` (flattened in `schema`) with this silo's share of the noise on every field with a sensitivity:
    rounded to the field's noise grid, plus Skellam of variance target / `counted`."""
    out = vector.to(torch.float64).clone()
    parts = torch.split(out, [f.size for f in schema.fields])
    for noise in noised_fields(schema.fields, multiplier):
        part = parts[schema.fields.index(noise.field)]
        share = SkellamShare(noise.variance, counted, participants)
        scale = 2.0**noise.bits
        draws = torch.from_numpy(share.sample(noise.field.size, rng)).to(torch.float64)
        part.copy_((torch.round(part * scale) + draws) / scale)
    return out
