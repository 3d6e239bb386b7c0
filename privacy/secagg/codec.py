"""Fixed-point encoding of a schema's fields into the ring of a secure sum (`ring.Ring`), each field in the
narrowest words that hold it.

A value x of a field with bound B, encoded with f fractional bits, becomes the integer round(x · 2^f) as a
two's-complement word. Summing n encodings with wrap-around and reading the result as a signed word gives the
sum of the rounded values, exactly, as long as it fits: |sum| ≤ n · ⌈B · 2^f⌉ < 2^(w−1) for w-bit words. The
codec picks, per field, for the round's n silos:
1. 32-bit words at the field's own precision f (its `frac_bits`) if the sum fits them;
2. else 32-bit words at the highest precision f' that fits, if f' ≥ `NARROW_MIN_FRAC_BITS` and the field is
   not a DP statistic (its noise is calibrated in units of the field's own precision, `privacy.dp.release`);
   precision drops here, so values are rounded stochastically (unbiased: E[encoded] = x · 2^f');
3. else 64-bit words at f, if the sum fits them; a round that could overflow even those is refused when the
   codec is made (`OverflowRisk`), before any silo encodes anything.
A model delta of bound 10 at 24 fractional bits fits 32-bit words up to 12 silos, and at 22 up to 51.

Rounding to nearest is off by at most 2^−(f+1) a value, so a decoded sum of n values is within n · 2^−(f+1)
of the sum of the clipped values. Stochastic rounding is off by less than 2^−f' a value (n · 2^−f' for the
sum) and is unbiased (to 2^−32 of a unit). Its uniforms, 32 bits each, come from a CSPRNG (AES-256-CTR,
`privacy.dp.noise.SecureRandom`) keyed with SHA-256 of the silo's own vector: a key only that silo can know
(the aggregator never sees the vector), fresh whenever the vector changes, and the same wherever the same
vector is encoded, so a simulation and a consortium still give the same sums bit for bit (a caller may pass
its own stream). The rounding of one vector is thereby fixed; across vectors its errors are independent and
unbiased, which is what the sums need. `error_bound` states the bound per field.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedlt.aggregation import Schema
from fedlt.aggregation.halves import SettingsRefused
from fedlt.aggregation.schema import Field
from privacy.dp.noise import SecureRandom
from privacy.ring import Ring

NARROW_MIN_FRAC_BITS = 16
ROUNDING_KEY = b"fedlt/secagg/stochastic-rounding/v1\x1f"
_LIMITS = {32: 2**31, 64: 2**63}


class OverflowRisk(SettingsRefused):
    """A round whose sums could leave 64-bit words at these bounds, silo count and precision."""


@dataclass(frozen=True)
class FieldEncoding:
    """How one field travels: in `bits`-bit words with `frac_bits` fractional bits, rounded stochastically
    when `stochastic` (its own precision did not fit those words)."""

    field: Field
    bits: int
    frac_bits: int
    stochastic: bool

    def error_bound(self, silos: int) -> float:
        """The most a decoded sum of `silos` encodings is off from the sum of the clipped values."""
        return silos * 2.0 ** -(self.frac_bits if self.stochastic else self.frac_bits + 1)


def _fits(field: Field, frac_bits: int, silos: int, bits: int) -> bool:
    return silos * math.ceil(field.bound * 2**frac_bits) < _LIMITS[bits]


def choose_encoding(field: Field, silos: int) -> FieldEncoding:
    """The narrowest words, at the highest precision up to the field's own, for a sum of `silos` values."""
    own = field.frac_bits
    if _fits(field, own, silos, 32):
        return FieldEncoding(field, 32, own, stochastic=False)
    if field.sensitivity == 0:
        lowered = next(
            (f for f in range(own - 1, NARROW_MIN_FRAC_BITS - 1, -1) if _fits(field, f, silos, 32)), None
        )
        if lowered is not None:
            return FieldEncoding(field, 32, lowered, stochastic=True)
    if _fits(field, own, silos, 64):
        return FieldEncoding(field, 64, own, stochastic=False)
    raise OverflowRisk(
        f"sums of {silos} silos could overflow 64 bits in {field.name} (bound {field.bound:g}, {own} "
        "fractional bits); lower the bounds, the precision or the number of silos"
    )


class FixedPointCodec:
    def __init__(self, schema: Schema, *, max_silos: int) -> None:
        if max_silos < 1:
            raise ValueError(f"need max_silos >= 1, got {max_silos}")
        self.schema, self.silos = schema, max_silos
        self.encodings = tuple(choose_encoding(f, max_silos) for f in schema.fields)
        wide = sum(e.field.size for e in self.encodings if e.bits == 64)
        self.ring = Ring(wide, schema.size - wide)
        # each field's place: its slice of the flat vector, its part of the ring (0 wide, 1 narrow) and offset
        self._places: list[tuple[FieldEncoding, slice, int, int]] = []
        start, offsets = 0, [0, 0]
        for e in self.encodings:
            part = 0 if e.bits == 64 else 1
            self._places.append((e, slice(start, start + e.field.size), part, offsets[part]))
            start += e.field.size
            offsets[part] += e.field.size

    def error_bound(self, name: str) -> float:
        """The most the decoded sum of field `name` is off from the sum of the silos' clipped values."""
        return next(e for e in self.encodings if e.field.name == name).error_bound(self.silos)

    def encode(self, vector: torch.Tensor, rng: SecureRandom | None = None) -> np.ndarray:
        """A flat float vector in schema order as a ring vector (values beyond their bounds are clipped).
        `rng` draws the stochastic rounding's uniforms, if any field needs them."""
        values = np.asarray(vector.detach().cpu().numpy(), dtype=np.float64)
        if values.shape != (self.schema.size,):
            raise ValueError(f"vector of shape {values.shape}, the schema needs {(self.schema.size,)}")
        if not np.isfinite(values).all():
            raise ValueError("cannot encode non-finite values")
        out = self.ring.zeros()
        parts = [p.view(np.int64 if p.dtype.itemsize == 8 else np.int32) for p in self.ring.parts(out)]
        for e, where, part, offset in self._places:
            scaled = np.clip(values[where], -e.field.bound, e.field.bound)
            scaled *= 2.0**e.frac_bits
            if e.stochastic:  # floor(v + u), u uniform in [0, 1): rounds up with probability frac(v)
                rng = rng or SecureRandom(hashlib.sha256(ROUNDING_KEY + values.tobytes()).digest())
                bits = rng.words((len(scaled) + 1) // 2).view(np.uint32)[: len(scaled)]  # 32 random bits each
                scaled += bits * 2.0**-32
                np.floor(scaled, out=scaled)
            else:
                np.rint(scaled, out=scaled)
            parts[part][offset : offset + e.field.size] = scaled
        return out

    def decode(self, vector: np.ndarray) -> torch.Tensor:
        """A sum of encodings (added in the ring) back to floats, in schema order."""
        parts = [p.view(np.int64 if p.dtype.itemsize == 8 else np.int32) for p in self.ring.parts(vector)]
        out = np.empty(self.schema.size, dtype=np.float64)
        for e, where, part, offset in self._places:
            np.divide(parts[part][offset : offset + e.field.size], 2.0**e.frac_bits, out=out[where])
        return torch.from_numpy(out)
