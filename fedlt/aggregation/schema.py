"""What a method declares before any data is seen: the named fields silos contribute and their bounds.

The privacy layers size everything from the schema alone: fixed-point ranges and overflow checks (secagg),
CKKS slots (ckks), noise sensitivities (dp). A silo's values are checked and clipped against it before they
leave the method, so a wrong shape or a NaN never reaches the wire.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fedlt.errors import ContributionError

FLOAT32_EXACT_INTEGERS = 2**24


@dataclass(frozen=True)
class Field:
    """`bound` is the largest absolute value any element may take; values beyond it are clipped.

    `frac_bits` is the fixed-point precision secure aggregation encodes the field with (0 for counts);
    `per_class` says the first axis indexes classes, which the tail guard may zero class by class.
    `sensitivity`, under DP, is the most one record can move the field (L2 norm; of one class row when per
    class, as a record belongs to one class): the field is a statistic of records that silos noise before
    release (`privacy.dp.release`). 0: not such a statistic (a model change DP-SGD made, a noised count).
    `float64`: a plaintext upload sends it as float64, not float32 (`wire_dtype`): a second moment, whose
    covariance subtracts nearly equal numbers, needs the digits.
    `inverts`: a per-class statistic that a few records' worth gives those records away (second moments,
    per-class gradients, random-feature sums): the tail guard's record floor zeroes it for classes with too
    few records (`tail_guard`), where counts and plain sums still go out.
    `whole_roster`: released only in sums over every silo of the silo's roster, zeroed in any other (held-out
    counts): a model can query it afresh from each state the aggregator picks, so two sums over sets that
    differ by one silo would give that silo's answers exactly (`round_sums.SiloRound`).
    """

    name: str
    shape: tuple[int, ...]
    bound: float
    doc: str = field(default="", compare=False)
    frac_bits: int = 24
    per_class: bool = False
    sensitivity: float = 0.0
    float64: bool = False
    inverts: bool = False
    whole_roster: bool = False

    @property
    def row_size(self) -> int:
        """Values one record can touch: a class row of a per-class field, else the whole field."""
        return self.size // self.shape[0] if self.per_class else self.size

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def wire_dtype(self) -> str:
        """How a plaintext upload carries it: float32 (the model's own precision), float64 where asked and for
        counts beyond float32's exact integers."""
        exact_limit = self.frac_bits == 0 and self.bound > FLOAT32_EXACT_INTEGERS
        return "<f8" if self.float64 or exact_limit else "<f4"


@dataclass(frozen=True)
class Schema:
    fields: tuple[Field, ...]
    phase: str = "train"

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        problems = [f"duplicate field {n!r}" for n in sorted(set(names)) if names.count(n) > 1]
        problems += [
            f"field {f.name!r} needs a finite bound > 0, got {f.bound}"
            for f in self.fields
            if not (math.isfinite(f.bound) and f.bound > 0)
        ]
        problems += [
            f"field {f.name!r} has an invalid shape {f.shape}"
            for f in self.fields
            if any(d < 1 for d in f.shape)
        ]
        problems += [
            f"field {f.name!r} needs 0 <= frac_bits <= 62, got {f.frac_bits}"
            for f in self.fields
            if not 0 <= f.frac_bits <= 62
        ]
        problems += [
            f"field {f.name!r} needs a finite sensitivity >= 0, got {f.sensitivity}"
            for f in self.fields
            if not (math.isfinite(f.sensitivity) and f.sensitivity >= 0)
        ]
        classes = {f.shape[0] if f.shape else 0 for f in self.fields if f.per_class}
        if len(classes) > 1 or 0 in classes:
            problems.append("per-class fields need a leading class axis of one common length")
        if not self.fields:
            problems.append("a schema needs at least one field")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def size(self) -> int:
        return sum(f.size for f in self.fields)

    @property
    def classes(self) -> int:
        """Length of the per-class fields' class axis; 0 when no field is per class."""
        return next((f.shape[0] for f in self.fields if f.per_class), 0)

    def contribution(self, **values: torch.Tensor | float) -> Contribution:
        """Check names, shapes and finiteness, clip to each field's bound, and freeze as float64."""
        expected = {f.name for f in self.fields}
        problems = [f"unknown field {n!r}" for n in sorted(set(values) - expected)]
        problems += [f"missing field {n!r}" for n in sorted(expected - set(values))]
        if problems:
            raise ContributionError("; ".join(problems))
        checked: dict[str, torch.Tensor] = {}
        clipped = 0
        for f in self.fields:
            t = torch.as_tensor(values[f.name], dtype=torch.float64).detach()
            if tuple(t.shape) != f.shape:
                problems.append(f"field {f.name!r} has shape {tuple(t.shape)}, schema says {f.shape}")
                continue
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                problems.append(f"field {f.name!r} has {bad} non-finite values")
                continue
            clipped += int((t.abs() > f.bound).sum())
            checked[f.name] = t.clamp(-f.bound, f.bound).contiguous()
        if problems:
            raise ContributionError("; ".join(problems))
        return Contribution(self, checked, clipped)

    def flatten(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One float64 vector in schema order: the form secure aggregation masks and CKKS encrypts."""
        return torch.cat([values[f.name].reshape(-1) for f in self.fields])

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        if vector.shape != (self.size,):
            raise ContributionError(f"vector of shape {tuple(vector.shape)}, schema needs ({self.size},)")
        parts = torch.split(vector, [f.size for f in self.fields])
        return {f.name: p.reshape(f.shape) for f, p in zip(self.fields, parts, strict=True)}


@dataclass(frozen=True)
class Contribution:
    """One silo's validated values for one round; made only by `Schema.contribution`."""

    schema: Schema
    values: Mapping[str, torch.Tensor]
    clipped: int = field(default=0)

    def flat(self) -> torch.Tensor:
        return self.schema.flatten(self.values)
