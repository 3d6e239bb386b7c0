"""The census and the tail guard: a per-class sum over fewer than k_min silos is one silo's data, so it is
never released. Layer-independent: the census is a sum too, carried by whichever privacy layer runs the round.

Once per phase (the phase's first round with per-class fields), a census sums each silo's per-class presence
securely (a class is present when any per-class field of the silo's contribution is non-zero for it) over that
round's silos; the silos it counts are the phase's census set P. Every later round of the phase reuses it:
**per-class fields are released only in sums over exactly P**, with the classes fewer than k_min of them hold
zeroed; a round over any other set (partial participation, a dropout) zeroes every per-class row.

Why so strict: what a silo holds does not change between rounds, so sums of presence (or of anything else
per class that stays put) over different silo sets form a linear system the aggregator can solve for each
silo's classes, and two censuses over sets that differ by one silo give that silo's classes outright. With
one census per phase and per-class sums over one set only, there is nothing to intersect. The census reveals
how many silos of P hold each class, never which.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedlt.aggregation.schema import Schema
from fedlt.errors import FedltError


class CensusError(FedltError):
    """A census result no honest set of silos could have produced; the silo that sees it leaves the round."""


@dataclass(frozen=True)
class Census:
    """How many of the census set's silos hold each class."""

    silos: tuple[str, ...]  # sorted
    counts: tuple[int, ...]

    @classmethod
    def of(cls, silos: Sequence[str], counts: Sequence[int] | np.ndarray) -> Census:
        return cls(tuple(sorted(silos)), tuple(int(c) for c in counts))

    def digest(self) -> bytes:
        return _digest("fedlt/census/v1", list(self.silos), list(self.counts))

    def binding(self, spec_hash: bytes) -> bytes:
        """What a contribution's consistency round signs: the RoundSpec and the census its guard used."""
        return hashlib.sha256(spec_hash + self.digest()).digest()

    def guarded(self, contributors: Sequence[str], k_min: int) -> list[int]:
        """The classes every silo zeroes in a sum over `contributors`: all of them unless it is the census
        set, else those some but fewer than `k_min` silos hold."""
        if tuple(sorted(contributors)) != self.silos:
            return list(range(len(self.counts)))
        return held_back(np.asarray(self.counts), k_min)


def phase_key(consortium: str, config_sha256: str, seed: int, phase: str) -> str:
    """Names the phase whose census a silo keeps: one census per (consortium, plan, seed, phase)."""
    return _digest("fedlt/phase/v1", consortium, config_sha256, seed, phase).hex()


def presence(schema: Schema, flat: torch.Tensor) -> np.ndarray:
    """1 for each class this contribution says something about, else 0 (uint64, ready to be summed)."""
    present = torch.zeros(schema.classes, dtype=torch.bool)
    for f, part in zip(schema.fields, torch.split(flat, [f.size for f in schema.fields]), strict=True):
        if f.per_class:
            present |= part.reshape(f.shape[0], -1).ne(0).any(dim=1)
    return present.numpy().astype(np.uint64)


def check_census(counts: np.ndarray, mine: np.ndarray, counted: int) -> None:
    """What a silo can check of a census result: its own classes are counted, no count exceeds the silos.

    It cannot check more: a malicious silo may add up to `counted` minus the true count to any class (its
    input is masked, and without zero-knowledge range proofs nobody can tell a 1 from a 3), which can lift a
    class one honest silo holds to k_min. docs/threat-model.md states this limit; a test pins it.
    """
    if len(counts) != len(mine) or (counts < mine).any() or (counts > counted).any():
        raise CensusError("the census result cannot be the sum of the silos' presence")


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


def _digest(*parts: object) -> bytes:
    """SHA-256 of an unambiguous encoding of `parts` (canonical JSON: strings cannot run into each other)."""
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).digest()
