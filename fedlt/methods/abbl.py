"""SFD's Adaptive Bi-Branch Learning losses (Eq. 5–8): adaptive cross-entropy and supervised contrast.

Both adjust by the silo's local class prior π (Eq. 6): its class counts, with a missing class given β_π times
the smallest non-zero count, so that with β_π > 0 a missing class still receives a repulsive gradient — plain
logit adjustment gives it none, because log 0 = −∞ removes it from the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prior_of_counts(counts: torch.Tensor, beta_pi: float) -> torch.Tensor:
    """π_k (Eq. 6): the local class counts (noised ones under DP); missing classes get β_π · the smallest
    non-zero count (0 when β_π = 0)."""
    smallest = counts[counts > 0].min() if (counts > 0).any() else torch.tensor(1.0)
    return torch.where(counts > 0, counts, beta_pi * smallest)


def adaptive_cross_entropy(
    logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, gamma: float
) -> torch.Tensor:
    """L_A-CE (Eq. 5): cross-entropy of logits + γ·log π, per record."""
    return F.cross_entropy(logits + gamma * torch.log(prior), y, reduction="none")


def adaptive_contrastive(
    projected: torch.Tensor,
    y: torch.Tensor,
    prior: torch.Tensor,
    temperature: float,
    delta_scale: float = 1.0,
) -> torch.Tensor:
    """L_A-SCL (Eq. 7) over a batch of projections, as the official code computes it.

    s_ij = ⟨h_i, h_j⟩/τ on L2-normalised projections; negatives j (other classes) get + Δ_{y_j} =
    delta_scale·log π_{y_j}; the denominator runs over all j ≠ i; the positives A(i) are the samples of
    y_i including i itself, as A(i) = {a | y_a = y_i} reads.
    """
    h = F.normalize(projected, dim=1)
    similarity = h @ h.T / temperature
    same = y[:, None] == y[None, :]
    logits = torch.where(same, similarity, similarity + delta_scale * torch.log(prior)[y][None, :])
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    others = ~torch.eye(len(y), dtype=torch.bool, device=y.device)
    log_denominator = torch.logsumexp(logits.masked_fill(~others, float("-inf")), dim=1, keepdim=True)
    log_prob = logits - log_denominator
    return -((log_prob * same).sum(1) / same.sum(1)).mean()


def contrastive_weight(first: float, round_number: int, rounds: int) -> float:
    """β_SCL^(r) = β_SCL^(1) · ½(1 + cos(π r / R)) (Eq. 28): representation first, boundaries later."""
    return first * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * round_number / rounds)).item())
