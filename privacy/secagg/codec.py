"""Fixed-point encoding of a schema's fields into Z_2^64, where masks and sums wrap around for free.

A value x of a field with bound B and f fractional bits (both from the schema) becomes round(x · 2^f) as a
two's-complement uint64. Summing n encodings with uint64 wrap-around and reading the result as int64 gives the
sum of the rounded values, exactly, as long as it fits in int64: |sum| ≤ n · B · 2^f < 2^63. A codec for a
round that could break that is refused when it is made, before any silo encodes anything. Each value is off by
at most 2^−(f+1) after rounding, so a decoded sum of n values is within n · 2^−(f+1) ≤ n · 2^−f of the truth.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedlt.aggregation import Schema
from fedlt.aggregation.halves import SettingsRefused

INT64_LIMIT = 2**63


class OverflowRisk(SettingsRefused):
    """A round whose sums could leave int64 at these bounds, silo count and precision."""


class FixedPointCodec:
    def __init__(self, schema: Schema, *, max_silos: int) -> None:
        if max_silos < 1:
            raise ValueError(f"need max_silos >= 1, got {max_silos}")
        risky = [
            f"{f.name} (bound {f.bound:g}, {f.frac_bits} fractional bits)"
            for f in schema.fields
            if max_silos * math.ceil(f.bound * 2**f.frac_bits) >= INT64_LIMIT
        ]
        if risky:
            raise OverflowRisk(
                f"sums of {max_silos} silos could overflow 64 bits in {', '.join(risky)}; "
                "lower the bounds, the precision or the number of silos"
            )
        self.schema = schema
        sizes = [f.size for f in schema.fields]
        self.bounds = np.repeat([float(f.bound) for f in schema.fields], sizes)
        self.scales = np.repeat([2.0**f.frac_bits for f in schema.fields], sizes)

    def encode(self, vector: torch.Tensor) -> np.ndarray:
        """A flat float vector in schema order as uint64 words (values beyond their bounds are clipped)."""
        values = np.asarray(vector.detach().cpu().numpy(), dtype=np.float64)
        if values.shape != self.bounds.shape:
            raise ValueError(f"vector of shape {values.shape}, the schema needs {self.bounds.shape}")
        if not np.isfinite(values).all():
            raise ValueError("cannot encode non-finite values")
        clipped = np.clip(values, -self.bounds, self.bounds)
        return np.rint(clipped * self.scales).astype(np.int64).view(np.uint64)

    def decode(self, words: np.ndarray) -> torch.Tensor:
        """A sum of encodings (added in uint64) back to floats."""
        return torch.from_numpy(words.astype(np.uint64, copy=False).view(np.int64) / self.scales)
