"""The tail guard: a per-class sum over fewer than k_min silos is one silo's data, so it is never released.

Before the contribution is masked, a census sums each silo's per-class presence securely (a class is present
when any per-class field of the silo's contribution is non-zero for it). Every silo then zeroes, in every
per-class field, the classes that fewer than k_min silos hold, so their rows of the released sum are zero.
The census itself reveals only how many silos hold each class, never which.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlt.aggregation import Schema


def presence(schema: Schema, flat: torch.Tensor) -> np.ndarray:
    """1 for each class this contribution says something about, else 0 (uint64, ready to be summed)."""
    present = torch.zeros(schema.classes, dtype=torch.bool)
    for f, part in zip(schema.fields, torch.split(flat, [f.size for f in schema.fields]), strict=True):
        if f.per_class:
            present |= part.reshape(f.shape[0], -1).ne(0).any(dim=1)
    return present.numpy().astype(np.uint64)


def held_back(counts: np.ndarray, k_min: int) -> list[int]:
    """Classes that some but fewer than `k_min` silos hold."""
    return [int(c) for c in np.flatnonzero((counts > 0) & (counts < k_min))]


def zero_classes(schema: Schema, flat: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """`flat` with the rows of `classes` zeroed in every per-class field."""
    if not classes:
        return flat
    out = flat.clone()
    for f, part in zip(schema.fields, torch.split(out, [f.size for f in schema.fields]), strict=True):
        if f.per_class:
            part.view(f.shape[0], -1)[classes] = 0
    return out
