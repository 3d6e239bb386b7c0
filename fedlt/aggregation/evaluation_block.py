"""Held-out evaluation inside the round's own sum, where the aggregator steps the model (secagg, plaintext).

Each silo evaluates the round's starting state, the state it fetched and checked against the signed digest,
on its own held-out slice, and appends the per-class counts to its contribution: the fields of
`halves.evaluation_fields` after the method's, summed by the layer with everything else. Nothing leaves a silo
outside that sum, and nothing new can be asked for twice: the counts are a function of the state the silo
trains from, which keys the contribution in its release gate, so the aggregator gets one evaluation per
state. And since secagg lets the aggregator choose the model, so that states of its making that predict alike
are new keys, the counts leave only in sums that list every silo of the roster (`Field.whole_roster`): sums
over sets that differ by one silo would give that silo's counts, and a crafted model makes `correct` any
counting query on its held-out images. What stays open: such queries on the pooled held-out data of every
silo, one per state. The aggregator strips the block (`split`) before the method's server step and records
the counts as the metrics of the starting state.

The first round (from the initial state) also carries each silo's training records per class (per class:
the census and the tail guard treat them as any per-class count), which give the shot groups. After the last
training round one more round carries the block alone (`evaluation_schema`, its own phase): every silo
evaluates the last committed state, trains nothing, and its release is keyed as any contribution's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedlt.aggregation.halves import EVALUATION_PHASE, evaluation_fields, evaluation_schema
from fedlt.aggregation.schema import Contribution, Schema
from fedlt.errors import ContributionError

CORRECT, TOTAL, RECORDS = (f.name for f in evaluation_fields(1, records=True))
BLOCK = frozenset((CORRECT, TOTAL, RECORDS))


@dataclass(frozen=True)
class HeldOutCounts:
    """A summed evaluation block: per class, test samples predicted right and test samples, and (first round
    only) training records as the silos reported them."""

    correct: tuple[int, ...]
    total: tuple[int, ...]
    records: tuple[int, ...] | None = None

    @property
    def evaluated(self) -> bool:
        """Whether the sum counted any held-out sample: silos keep their counts home in a sum that does not
        list every silo of their roster (`Field.whole_roster`)."""
        return sum(self.total) > 0

    def problems(self) -> list[str]:
        """Why no set of honest silos could have summed these counts (a malicious silo can bias a sum)."""
        pairs = zip(self.correct, self.total, strict=True)
        if any(c < 0 or c > t for c, t in pairs):
            return ["a class has fewer test samples than right predictions, or a negative count"]
        if self.records is not None and min(self.records, default=0) < 0:
            return ["a class has a negative record count"]
        return []


def round_schema(method: Schema | None, classes: int, *, first: bool) -> Schema:
    """What a round sums under held-out evaluation: the method's fields, then the evaluation block (with the
    records when the round starts from the initial state, `first`), in the method's phase so its census is
    the method's; `method` None is the evaluation-only round after the last."""
    if method is None:
        return evaluation_schema(classes)
    clash = sorted(BLOCK & {f.name for f in method.fields})
    if clash:
        raise ContributionError(f"the method's fields {clash} collide with the evaluation block")
    return Schema((*method.fields, *evaluation_fields(classes, records=first)), phase=method.phase)


def only_evaluates(schema: Schema) -> bool:
    """Whether a round trains nothing: its schema is the evaluation block alone."""
    return schema.phase == EVALUATION_PHASE and {f.name for f in schema.fields} <= BLOCK


def contribution(
    schema: Schema,
    trained: Contribution | None,
    counts: torch.Tensor,
    records: torch.Tensor | None = None,
) -> Contribution:
    """A silo's contribution to a round of `schema` (`round_schema`): the method's `trained` values (None in
    the evaluation-only round), its correct and total counts (`counts`, one vector, correct first) and, where
    the schema asks, its record counts."""
    values = {} if trained is None else dict(trained.values)
    classes = len(counts) // 2
    values[CORRECT], values[TOTAL] = counts[:classes], counts[classes:]
    if RECORDS in {f.name for f in schema.fields}:
        if records is None:
            raise ContributionError("the round asks for the silo's record counts, and none were given")
        values[RECORDS] = records
    return schema.contribution(**values)


def split(schema: Schema, total: torch.Tensor) -> tuple[Schema | None, torch.Tensor, HeldOutCounts]:
    """A summed vector of `schema` taken apart: the method's schema and part of the sum (None and an empty
    vector in the evaluation-only round), and the summed counts."""
    fields = schema.unflatten(total)
    method = tuple(f for f in schema.fields if f.name not in BLOCK)
    counted = {name: _counts(fields[name]) for name in BLOCK & set(fields)}
    if {CORRECT, TOTAL} - set(counted):
        raise ContributionError("the round's schema carries no evaluation block")
    counts = HeldOutCounts(counted[CORRECT], counted[TOTAL], counted.get(RECORDS))
    if not method:
        return None, total.new_zeros(0), counts
    stripped = Schema(method, phase=schema.phase)
    return stripped, stripped.flatten(fields), counts


def _counts(summed: torch.Tensor) -> tuple[int, ...]:
    """Counts travel on the integer grid (0 fractional bits); noised record counts are rounded there too."""
    return tuple(int(v) for v in np.rint(summed.numpy()))
