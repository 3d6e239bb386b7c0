"""What per-class presence counts over sets of silos pin down about each silo.

A census tells, for each class, how many of its silos hold it. One census alone pins a silo's bit only where
the count is 0 or all of its silos; two over different sets (a silo left out of the second) can pin the
left-out silo's every bit. The strongest reading of a set of such sums is exhaustive: every 0/1 holding of a
class consistent with all of them, and the bits on which every one agrees. Used by the protocol attack on
changing participant sets (`attacks.protocol`) and on the censuses a deployment's store keeps
(`attacks.aggregator_data`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np

MAX_SILOS = 20  # 2^20 holdings a class: the most an exhaustive reading enumerates
UNKNOWN = -1

Sums = Sequence[tuple[Sequence[int], int]]  # one class: (the silos summed, by index; their presence sum)


@functools.cache
def holdings(silos: int) -> np.ndarray:
    """Every 0/1 holding of one class over `silos` silos: [2^silos, silos] int8."""
    if silos > MAX_SILOS:
        raise ValueError(f"{silos} silos: an exhaustive reading stops at {MAX_SILOS}")
    return ((np.arange(2**silos)[:, None] >> np.arange(silos)) & 1).astype(np.int8)


def pinned(sums: Sums, silos: int) -> np.ndarray:
    """Each silo's presence bit of the class where every holding consistent with `sums` agrees on it, else
    `UNKNOWN`; all `UNKNOWN` where no holding is consistent (sums that contradict each other)."""
    every = holdings(silos)
    fits = np.ones(len(every), dtype=bool)
    for members, value in sums:
        fits &= every[:, list(members)].sum(axis=1) == value
    consistent = every[fits]
    found = np.full(silos, UNKNOWN, dtype=np.int8)
    if len(consistent):
        agreed = (consistent == consistent[0]).all(axis=0)
        found[agreed] = consistent[0][agreed]
    return found


MAX_SUBSETS = 8  # sums of a class read in every combination up to this many; beyond, one and two at a time


def pinned_beyond_each(per_class: Sequence[Sums], silos: int) -> tuple[int, int]:
    """(bits pinned by some combination of the sums, bits pinned by some single sum alone), over every class:
    what the sums give beyond what any one of them gives by its own counts. Combinations, not only all of
    them at once: sums taken at different times need not agree (a silo's holdings change), and sums that
    contradict each other pin nothing together while a consistent pair of them may pin a silo's bit."""
    together = alone = 0
    for sums in per_class:
        single = np.zeros(silos, dtype=bool)
        for one in sums:
            single |= pinned([one], silos) != UNKNOWN
        combined = single.copy()
        sizes = range(2, len(sums) + 1) if len(sums) <= MAX_SUBSETS else (2,)
        for size in sizes:
            for group in itertools.combinations(sums, size):
                combined |= pinned(group, silos) != UNKNOWN
        together += int(combined.sum())
        alone += int(single.sum())
    return together, alone
