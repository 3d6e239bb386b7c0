"""The census and the tail guard: a per-class sum over fewer than k_min silos is one silo's data, so it is
never released. Layer-independent: the census is a sum too, carried by whichever privacy layer runs the round.

Once per phase (the phase's first round with per-class fields), a census sums each silo's per-class presence
securely (a class is present when any per-class field of the silo's contribution is non-zero for it) over that
round's silos; the silos it counts are the phase's census set P. Every later round of the phase reuses it:
**per-class fields are released only in sums over exactly P**, with the classes fewer than k_min of them hold
zeroed; a round over any other set (partial participation, a dropout) zeroes every per-class row.

Why so strict: what a silo holds does not change between rounds, so sums of presence (or of anything else
per class that stays put) over different silo sets form a linear system the aggregator can solve for each
silo's classes, and two censuses over sets that differ by one silo give that silo's classes outright. So a
silo gives its presence to one set of silos only, whatever phase, plan or seed a RoundSpec names (its release
gate keys the census by the presence it sends), and per-class sums go over that set only: there is nothing to
intersect. The census reveals how many silos of P hold each class, never which.

**Statistics that invert, and the record floor.** k_min counts silos, not records: two silos holding one
record each pass k_min = 2, and their Σz, Σzzᵀ and n = 2 invert into both records' features
(`attacks.moments`). Measured with the audit's attack (docs/BENCHMARKS.md, "The record floor"), a class's
second moments give its records back at every size the long tail has (1 to 80 records): post-ReLU features
are non-negative, which pins down the rotation the moments leave free. So by default the fields that invert
(`Field.inverts`: second moments, per-class gradients, random-feature sums) leave a silo only under DP
(`ONLY_UNDER_DP`): a silo refuses a plan that would release them without it (`inverting_problems`). A
consortium and every silo may knowingly accept a numeric floor r ≥ 2 instead: the census then also sums, per
class, each silo's record count capped at r (`census_input`), and the rows of a class fewer than r records
hold are zeroed in every field that inverts even when k_min silos hold it; its counts and plain sums still
go out. The cap keeps the census from saying more than "enough". Such a floor stops the closed-form cases
(one or two records), not the rotation search.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedlt.aggregation.schema import Schema
from fedlt.config import setting
from fedlt.errors import FedltError

# a record floor of 0: statistics that invert leave a silo only under DP (the default of every layer's
# settings and every silo's policy; benchmarks/record_floor.py)
ONLY_UNDER_DP = 0


@dataclass(frozen=True)
class GuardSettings:
    """The tail guard's settings, written once: the settings of every layer that hides inputs inherit them,
    so they sit in its section of consortium.toml and its round parameters. A layer whose settings do not
    (plaintext: the aggregator sees every input anyway) runs without the guard (`guard_of`)."""

    k_min: int = setting(2, ge=0, doc="tail guard: zero per-class fields of classes fewer silos hold; <2 off")
    min_records: int = setting(
        ONLY_UNDER_DP,
        ge=0,
        doc="per-class statistics that invert (second moments, per-class gradients) leave silos without [dp] "
        "only for classes this many records hold; 0: never without [dp] (they invert at any class size)",
    )

    def describe_guard(self) -> str:
        floor = (
            f"record floor {self.min_records}" if self.min_records else "statistics that invert only under DP"
        )
        return f"tail guard k_min {self.k_min}, {floor}" if self.k_min >= 2 else "tail guard off"


def guard_of(settings: object) -> GuardSettings:
    """The tail guard a layer's settings (or round parameters) set: off for a layer without it."""
    return settings if isinstance(settings, GuardSettings) else GuardSettings(k_min=0)


class CensusError(FedltError):
    """A census result no honest set of silos could have produced; the silo that sees it leaves the round."""


@dataclass(frozen=True)
class Census:
    """How many of the census set's silos hold each class and, with a record floor, how many records (each
    silo's count capped at the floor)."""

    silos: tuple[str, ...]  # sorted
    counts: tuple[int, ...]
    records: tuple[int, ...] = ()  # empty without a record floor

    @classmethod
    def of(
        cls,
        silos: Sequence[str],
        counts: Sequence[int] | np.ndarray,
        records: Sequence[int] | np.ndarray = (),
    ) -> Census:
        return cls(tuple(sorted(silos)), tuple(int(c) for c in counts), tuple(int(r) for r in records))

    @classmethod
    def from_sum(cls, silos: Sequence[str], total: Sequence[int] | np.ndarray, classes: int) -> Census:
        """The census a summed `census_input` gives: silos per class, then (with a floor) capped records."""
        total = [int(v) for v in total]
        return cls.of(silos, total[:classes], total[classes:])

    def vector(self) -> tuple[int, ...]:
        """The summed `census_input` this census was read from."""
        return self.counts + self.records

    def digest(self) -> bytes:
        if not self.records:
            return _digest("fedlt/census/v1", list(self.silos), list(self.counts))
        return _digest("fedlt/census/v2", list(self.silos), list(self.counts), list(self.records))

    def binding(self, spec_hash: bytes) -> bytes:
        """What a contribution's consistency round signs: the RoundSpec and the census its guard used."""
        return hashlib.sha256(spec_hash + self.digest()).digest()

    def guarded(self, contributors: Sequence[str], k_min: int) -> list[int]:
        """The classes every silo zeroes, in every per-class field, in a sum over `contributors`: all of them
        unless it is the census set, else those some but fewer than `k_min` silos hold."""
        if tuple(sorted(contributors)) != self.silos:
            return list(range(len(self.counts)))
        return held_back(np.asarray(self.counts), k_min)

    def floored(self, record_floor: int) -> list[int]:
        """The classes the census set holds but fewer than `record_floor` records of: zeroed in the fields
        that invert."""
        if record_floor <= 1 or not self.records:
            return []
        counts, records = np.asarray(self.counts), np.asarray(self.records)
        return [int(c) for c in np.flatnonzero((counts > 0) & (records < record_floor))]


def phase_key(consortium: str, config_sha256: str, seed: int, phase: str) -> str:
    """Names the phase whose census the aggregator keeps and names in its RoundSpecs; silos key their own
    record by the presence they sent, not by this label (`gate.Subject`)."""
    return _digest("fedlt/phase/v1", consortium, config_sha256, seed, phase).hex()


def census_input(present: np.ndarray, records: np.ndarray | None, record_floor: int) -> np.ndarray:
    """What a silo sends to the census: its presence flags and, with a record floor, its record count of each
    class it holds, capped at the floor (at least one where it holds the class: rows need records). Without
    its counts (`records` None) a silo claims one record per class it holds, the fewest it can hold."""
    present = np.asarray(present, dtype=np.uint64)
    if record_floor <= 1:
        return present
    held = present if records is None else np.asarray(records, dtype=np.uint64)
    capped = np.where(present > 0, np.clip(held, 1, record_floor), 0).astype(np.uint64)
    return np.concatenate([present, capped])


def inverting_problems(schema: Schema, record_floor: int, *, dp: bool, accepted: int) -> list[str]:
    """Why a silo whose policy accepts a record floor of `accepted` (0: none, only DP) refuses to release
    `schema`'s statistics that invert, in a round with `record_floor` and DP on or off."""
    fields = [f.name for f in schema.fields if f.per_class and f.inverts]
    if dp or not fields:
        return []
    if accepted == ONLY_UNDER_DP:
        return [
            f"it would release {', '.join(fields)} without [dp]: per-class statistics that give the records "
            "back at any class size (docs/threat-model.md); this silo releases them only under DP "
            "(policy.min_class_records = 0)"
        ]
    if record_floor < accepted:
        return [
            f"it would release {', '.join(fields)} without [dp] under a record floor of {record_floor}, "
            f"below policy.min_class_records {accepted}"
        ]
    return []


def floor_problems(record_floor: int, *, dp: bool, accepted: int) -> list[str]:
    """Why a silo refuses a round's record floor: its census caps record counts at the floor, and sums of
    capped counts over one silo set at several floors give the counts away (Σ min(nᵢ, r) as r grows bends
    at every nᵢ; found in review), so a silo caps at one floor only, its policy's. Under DP every silo claims
    every class at the floor, which says nothing."""
    if dp or record_floor <= 1 or record_floor == accepted:
        return []
    return [
        f"its record floor {record_floor} is not this silo's policy.min_class_records {accepted}: a silo "
        "sends capped record counts at one floor only"
    ]


def presence(schema: Schema, flat: torch.Tensor) -> np.ndarray:
    """1 for each class this contribution says something about, else 0 (uint64, ready to be summed)."""
    present = torch.zeros(schema.classes, dtype=torch.bool)
    for f, part in zip(schema.fields, torch.split(flat, [f.size for f in schema.fields]), strict=True):
        if f.per_class:
            present |= part.reshape(f.shape[0], -1).ne(0).any(dim=1)
    return present.numpy().astype(np.uint64)


def check_census(counts: np.ndarray, mine: np.ndarray, counted: int, record_floor: int = 1) -> None:
    """What a silo checks of any census, whatever the layer: its own classes are counted, no count exceeds the
    silos.

    The counts are not the aggregator's word alone where inputs are hidden from it: under `secagg` they are
    the sum the silo recomputed from every counted silo's signed masked input and reveal
    (`privacy.secagg.protocol.Transcript`), and the round driver refuses a reported count that differs;
    under `ckks` the silo decrypts them itself. What stays: a malicious silo may add up to `counted` minus
    the true count to any class (its input is masked, and without zero-knowledge range proofs nobody can
    tell a 1 from a 3), which can lift a class one honest silo holds to k_min. docs/threat-model.md states
    this limit; a test pins it.
    """
    classes = len(counts) // 2 if record_floor > 1 else len(counts)
    silos, records = counts[:classes], counts[classes:]
    plausible = len(counts) == len(mine) and (counts >= mine).all() and (silos <= counted).all()
    if plausible and record_floor > 1:  # each holder adds at least one record and at most the floor
        plausible = (
            len(records) == classes and (silos <= records).all() and (records <= silos * record_floor).all()
        )
    if not plausible:
        raise CensusError("the census result cannot be the sum of the silos' presence")


def held_back(counts: np.ndarray, k_min: int) -> list[int]:
    """Classes that some but fewer than `k_min` silos hold."""
    return [int(c) for c in np.flatnonzero((counts > 0) & (counts < k_min))]


def zero_classes(
    schema: Schema, flat: torch.Tensor, classes: list[int], *, inverting: list[int] = ()
) -> torch.Tensor:
    """`flat` with the rows of `classes` zeroed in every per-class field, and those of `inverting` in the
    fields that invert."""
    if not classes and not inverting:
        return flat
    out = flat.clone()
    for f, part in zip(schema.fields, torch.split(out, [f.size for f in schema.fields]), strict=True):
        rows = sorted({*classes, *inverting}) if f.inverts else list(classes)
        if f.per_class and rows:
            part.view(f.shape[0], -1)[rows] = 0
    return out


def _digest(*parts: object) -> bytes:
    """SHA-256 of an unambiguous encoding of `parts` (canonical JSON: strings cannot run into each other)."""
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).digest()
