"""The opening round of a table study: every numeric feature's pooled mean and standard deviation, from secure
sums, written into the model's `Standardise` layer before any training.

Each silo contributes, per numeric column, the rows that hold a value, their sum and their sum of squares, in
the schema's scaled units (u = (x − min)/(max − min), so every bound follows from the row count); the layer
sums them like any contribution, so no silo's own statistics leave it. The sums are the pooled moments:
mean = Σu/n, variance = Σu²/n − mean². They are released once per run, and only in sums over a silo's whole
roster (`Field.whole_roster`): the aggregator can make a fresh initial state, and with it a fresh release,
whenever it likes, and two sums over sets that differ by one silo would give that silo's moments.

Under [dp] no opening round runs (the moments would be one more statistic to noise and budget): features stay
scaled by the schema's declared ranges, which costs no budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedlt.aggregation import Field, Schema, Sums
from fedlt.errors import ContributionError
from fedlt.methods.state import GlobalState

PHASE = "standardise"
MAX_ROWS = float(2**24)  # per silo: bounds every field, u being in [0, 1]
COUNT, TOTAL, SQUARES = "column_count", "column_sum", "column_squares"
CONSTANT = 1e-6  # a standard deviation below this many of a column's declared ranges: the column is constant


def schema(columns: int) -> Schema:
    """The opening round's fields for `columns` numeric columns."""

    def moment(name: str, doc: str) -> Field:
        return Field(name, (columns,), MAX_ROWS, doc, whole_roster=True, float64=True)

    count = Field(COUNT, (columns,), MAX_ROWS, "rows holding a value", frac_bits=0, whole_roster=True)
    return Schema((count, moment(TOTAL, "Σu over those rows"), moment(SQUARES, "Σu² over them")), phase=PHASE)


def moments(x: np.ndarray, numeric: Sequence[int], indicators: Sequence[int]) -> dict[str, torch.Tensor]:
    """A silo's contribution: per numeric column of its encoded rows `x` (`numeric`: the columns' features;
    `indicators`: each one's missing indicator, -1 for none), the rows with a value, Σu and Σu²."""
    rows = torch.from_numpy(x).to(torch.float64)
    values = rows[:, list(numeric)]
    present = torch.ones_like(values)
    flags = torch.tensor(list(indicators), dtype=torch.int64)
    flagged = flags >= 0
    present[:, flagged] = 1 - rows[:, flags[flagged]]
    kept = values * present
    return {COUNT: present.sum(0), TOTAL: kept.sum(0), SQUARES: (kept * values).sum(0)}


def standardised(state: GlobalState, sums: Sums, prefix: str) -> GlobalState:
    """The next state: the layer at `prefix` (its state-dict prefix) holds the pooled mean and 1/std."""
    count = sums[COUNT].round()
    if not bool((count > 0).all()):
        empty = [int(i) for i in torch.nonzero(count <= 0).flatten()]
        raise ContributionError(f"the opening round summed no value of numeric column(s) {empty}")
    mean = sums[TOTAL] / count
    std = (sums[SQUARES] / count - mean**2).clamp(min=0).sqrt()
    scale = torch.where(std > CONSTANT, 1 / std.clamp(min=CONSTANT), torch.ones_like(std))
    model = dict(state.model)
    model[f"{prefix}mean"] = mean.to(model[f"{prefix}mean"].dtype)
    model[f"{prefix}scale"] = scale.to(model[f"{prefix}scale"].dtype)
    model[f"{prefix}ready"] = torch.ones_like(model[f"{prefix}ready"])
    return GlobalState(state.round + 1, model, state.extra)


def is_ready(state: GlobalState, prefix: str) -> bool:
    return bool(state.model[f"{prefix}ready"])
