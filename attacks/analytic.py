"""Attack (a): a feature recovered exactly from a per-class gradient of a linear head (CReFF, RedGrape).

For a head s = Wz + b under cross-entropy, one record's gradient has rows ∂L/∂W_j = (p_j − 1[j = y])·z and
∂L/∂b_j = p_j − 1[j = y], so z = (∂L/∂W_j) / (∂L/∂b_j) for any row j with a non-zero bias gradient (Phong et
al. 2018; Geiping et al. 2020). The label is the row whose bias gradient is negative (iDLG). A class one
record represents therefore gives that record's feature to float precision; a class of several records gives
a weighted mean of theirs (a class prototype). The label needs no recovery here: the rows are per class.
The row used is the one with the largest |∂L/∂b_j|, the best
conditioned division.
"""

from __future__ import annotations

import torch

ZERO = 1e-4  # a bias gradient this small is a withheld row: CKKS decrypts an exact zero as noise of ~1e-6


def recover_feature(rows: torch.Tensor) -> torch.Tensor | None:
    """The feature behind one class's [∂L/∂W | ∂L/∂b] rows (classes, d + 1); None if the rows are zero
    (a class withheld by the tail guard, or absent). A record the head already fits to within `ZERO` of
    certainty would read as withheld too; its gradient is that small."""
    rows = rows.double()
    bias = rows[:, -1]
    j = int(torch.argmax(bias.abs()))
    if bias[j].abs() <= ZERO:
        return None
    return rows[j, :-1] / bias[j]


def relative_error(found: torch.Tensor | None, truth: torch.Tensor) -> float:
    if found is None:
        return float("inf")
    truth = truth.double()
    return float((found.double() - truth).norm() / truth.norm().clamp_min(1e-12))
