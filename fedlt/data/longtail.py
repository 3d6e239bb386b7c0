"""Exponential long-tail subsampling, n_c = n_max · IF^(−c/(C−1)), head = class 0 (Cao et al. 2019, CReFF)."""

from __future__ import annotations

import math

import numpy as np

from fedlt.data.arrays import LabeledData
from fedlt.errors import DataError


def longtail_counts(n_max: int, num_classes: int, imbalance: float) -> list[int]:
    """Per-class sample counts; floor of the formula (as CReFF's `int()`), and never below one sample.

    The 1e-9 guards floor() against 4.000000000001-style float error turning an exact count into one less.
    """
    if num_classes < 2:
        raise ValueError("a long tail needs at least two classes")
    if imbalance < 1:
        raise ValueError(f"imbalance factor must be >= 1, got {imbalance}")
    return [
        max(1, math.floor(n_max * imbalance ** (-c / (num_classes - 1)) + 1e-9)) for c in range(num_classes)
    ]


def longtail_subsample(data: LabeledData, *, imbalance: float, seed: int) -> LabeledData:
    """Keep n_c random samples of class c; n_max is the smallest class's size so every class can supply."""
    available = data.class_counts()
    if available.min() == 0:
        raise DataError(data.source, "every class needs samples before the long-tail cut")
    targets = longtail_counts(int(available.min()), data.num_classes, imbalance)
    rng = np.random.default_rng(seed)
    keep = [rng.choice(np.flatnonzero(data.y == c), n, replace=False) for c, n in enumerate(targets)]
    return data.subset(np.sort(np.concatenate(keep)))
