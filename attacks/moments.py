"""Attack (b): the records of a small class recovered from its moments Σz, Σzzᵀ and count (CCVR, DFL-FS, SFD).

With n = 1 the sum is the record. With n = 2, S = z₁ + z₂ and M = z₁z₁ᵀ + z₂z₂ᵀ give
M − SSᵀ/2 = ½(z₁ − z₂)(z₁ − z₂)ᵀ, a rank-one matrix whose top eigenpair (λ, v) yields z₁ − z₂ = ±√(2λ)·v and
z₁,₂ = (S ± √(2λ)·v) / 2 exactly (`../shared/research/privacy.md` §4d). Larger classes give their mean only
(a prototype, which the decoder turns into a class-typical image). The count comes from the released sums
too; a noised count is rounded, as an attacker would.
"""

from __future__ import annotations

import torch

from fedlt.methods.feature_stats import unpack_symmetric


def invert_moments(feature_sum: torch.Tensor, outer_sum: torch.Tensor, count: float) -> torch.Tensor | None:
    """The records (n, d) a class's sums imply for n = 1 or 2; the mean (1, d) for more; None when the
    released count says the class is absent (or withheld)."""
    n = round(float(count))
    if n < 1:
        return None
    s = feature_sum.double()
    if n == 1:
        return s[None]
    if n > 2:
        return (s / n)[None]
    centred = unpack_symmetric(outer_sum.double(), len(s)) - torch.outer(s, s) / 2
    values, vectors = torch.linalg.eigh(centred)
    half_gap = torch.sqrt(2 * values[-1].clamp_min(0.0)) * vectors[:, -1] / 2
    return torch.stack([s / 2 + half_gap, s / 2 - half_gap])


def matched_error(found: torch.Tensor | None, truth: torch.Tensor) -> float:
    """The largest relative error over the true records, each paired with its nearest recovered one (the
    order of z₁ and z₂ is not identifiable)."""
    if found is None:
        return float("inf")
    truth = truth.double()
    distances = torch.cdist(truth, found.double())
    return float((distances.min(dim=1).values / truth.norm(dim=1).clamp_min(1e-12)).max())
