"""SFD's Statistically Aligned Feature Synthesis (Eq. 11–17, Algorithm 1): synthetic features of one class.

A memory bank of M_c random vectors is passed through the MeanCov aligner, which maps it onto exactly the
class's global mean and covariance, and the bank is then optimised so that the aligned features also match the
class's random-feature mean (L1 MMD, Eq. 15) and stay non-negative like post-ReLU features (ARR, Eq. 16).
Defaults are the official code's: 100 full-batch steps of SGD with lr 1.0, momentum 0.9 and cosine
annealing; Cholesky in float64 with 1e-5 (target) and 1e-6 (bank) added to the diagonals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class MeanCovAligner:
    """Z ↦ (Z − mean(Z))·Aᵀ + μ_g with A = L_g·L_Z⁻¹ (Eq. 11–14), differentiable in Z.

    L_g is the Cholesky factor of the target covariance (+ `target_eps`·I), computed once; L_Z that of the
    bank's unbiased covariance (+ `input_eps`·I) at every call. With `input_eps` = 0 the output has exactly
    the target mean and covariance (to the bank dtype's rounding).
    """

    def __init__(self, mean: torch.Tensor, covariance: torch.Tensor, *, target_eps: float, input_eps: float):
        dim = len(mean)
        self.mean = mean.double()
        self.target = covariance.double() + target_eps * torch.eye(dim, dtype=torch.float64)
        self.target_factor = torch.linalg.cholesky(self.target)
        self.input_eps = input_eps

    def __call__(self, bank: torch.Tensor) -> torch.Tensor:
        """In the bank's dtype, except the Cholesky factor and the triangular solve, which are float64."""
        centred = bank - bank.mean(0)
        covariance = (centred.T @ centred).double() / (len(bank) - 1)
        covariance = covariance + self.input_eps * torch.eye(bank.shape[1], dtype=torch.float64)
        factor = torch.linalg.cholesky(covariance)
        # A = L_g L_Z⁻¹, i.e. A L_Z = L_g, solved against the triangular factor without forming an inverse
        transform = torch.linalg.solve_triangular(factor, self.target_factor, upper=False, left=False)
        return centred @ transform.T.to(bank.dtype) + self.mean.to(bank.dtype)


@dataclass(frozen=True)
class SynthesisSettings:
    steps: int = 100
    lr: float = 1.0
    momentum: float = 0.9
    target_eps: float = 1e-5
    input_eps: float = 1e-6
    aligner: bool = True
    mmd: bool = True


def synthesize_class(
    count: int,
    mean: torch.Tensor,
    covariance: torch.Tensor,
    rff_mean: torch.Tensor,
    rff: Callable[[torch.Tensor], torch.Tensor],
    settings: SynthesisSettings,
    generator: torch.Generator,
) -> torch.Tensor:
    """`count` synthetic features of one class (float32)."""
    bank = torch.randn(count, len(mean), generator=generator).requires_grad_(True)
    align = (
        MeanCovAligner(mean, covariance, target_eps=settings.target_eps, input_eps=settings.input_eps)
        if settings.aligner
        else None
    )
    optimizer = torch.optim.SGD([bank], lr=settings.lr, momentum=settings.momentum)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(settings.steps, 1))
    target = rff_mean.float()
    for _ in range(settings.steps):
        z = align(bank) if align else bank
        loss = torch.relu(-z).sum(1).mean()  # ARR (Eq. 16), averaged over the bank
        if settings.mmd:
            loss = loss + (target - rff(z).mean(0)).abs().sum()  # L1 MMD (Eq. 15)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        return (align(bank) if align else bank).float()


def synthetic_counts(class_sizes: torch.Tensor, most: int, fewest: int) -> torch.Tensor:
    """M_c by the rank of the class's size among the distinct sizes: `most` for the rarest, `fewest` for the
    most frequent, linear in rank (not in size) between them, as the official `make_syn_nums`."""
    distinct = torch.unique(class_sizes)
    rank = torch.searchsorted(distinct, class_sizes).double()
    span = max(len(distinct) - 1, 1)
    return torch.round(most - rank / span * (most - fewest)).long()
