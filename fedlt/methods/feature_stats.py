"""Per-class feature statistics as sums: Σz, Σzzᵀ and counts, and the class Gaussians formed from them.

Pooling per-silo means and covariances (CCVR, DFL-FS Eq. 1–2) is the same as pooling these three sums:
μ_c = Σz / n_c and Σ_c = (Σzzᵀ − n_c μ_c μ_cᵀ) / (n_c − 1) — the unbiased covariance of the pooled features.
Sums are what secure aggregation adds, and the outer-product form avoids the scalar-`np.dot` slip of two
public implementations. Σzzᵀ is symmetric, so only its upper triangle (d(d+1)/2 values) travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def upper_size(dim: int) -> int:
    return dim * (dim + 1) // 2


def class_sums(z: torch.Tensor, y: torch.Tensor, classes: int) -> dict[str, torch.Tensor]:
    """feature_sum (C, d), outer_sum (C, d(d+1)/2) and count (C,) of one silo's features, in float64, on
    the features' device."""
    z64 = z.double()
    dim = z64.shape[1]
    rows, cols = torch.triu_indices(dim, dim, device=z.device)
    members = F.one_hot(y, classes).double()
    outer = torch.zeros(classes, upper_size(dim), dtype=torch.float64, device=z.device)
    for c in torch.unique(y).tolist():
        zc = z64[y == c]
        outer[c] = (zc.T @ zc)[rows, cols]
    return {"feature_sum": members.T @ z64, "outer_sum": outer, "count": members.sum(0)}


def unpack_symmetric(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """(..., d(d+1)/2) upper triangles back to (..., d, d) symmetric matrices."""
    rows, cols = torch.triu_indices(dim, dim)
    full = torch.zeros(*packed.shape[:-1], dim, dim, dtype=packed.dtype)
    full[..., rows, cols] = packed
    full[..., cols, rows] = packed
    return full


@dataclass(frozen=True)
class ClassGaussians:
    """Pooled per-class means (C, d), covariances (C, d, d) and counts (C,), in float64."""

    means: torch.Tensor
    covariances: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def from_sums(
        cls,
        feature_sum: torch.Tensor,
        outer_sum: torch.Tensor,
        count: torch.Tensor,
        *,
        unbiased: bool = True,
    ) -> ClassGaussians:
        """Unbiased covariances (divided by n_c − 1; CCVR, DFL-FS), or population ones (by n_c; SFD's Eq. 10).

        Classes with no samples get zeros; a class with one sample gets a zero covariance. Covariances are
        projected onto the positive semi-definite cone (negative eigenvalues set to zero): the secure layers
        round Σzzᵀ to their fixed-point grid and DP noises it, and for a class with fewer records than
        dimensions either leaves the scatter indefinite. The projection is post-processing (no privacy
        cost)."""
        counts = count.round()
        n = counts.clamp(min=1)[:, None]
        means = feature_sum / n
        scatter = unpack_symmetric(outer_sum, feature_sum.shape[1]) - n[:, :, None] * torch.einsum(
            "ci,cj->cij", means, means
        )
        divisor = (counts - 1).clamp(min=1) if unbiased else counts.clamp(min=1)
        covariances = scatter / divisor[:, None, None]
        covariances[counts < 2] = 0.0
        values, vectors = torch.linalg.eigh(covariances)
        covariances = (vectors * values.clamp(min=0)[:, None, :]) @ vectors.transpose(1, 2)
        return cls(means, covariances, counts)

    @property
    def present(self) -> torch.Tensor:
        return self.counts > 0

    def sample(self, per_class: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`per_class` draws from N(μ_c, Σ_c) for every present class, as float32 (features, labels)."""
        return self.sample_counts(torch.full_like(self.counts, per_class).long(), generator)

    def sample_counts(
        self, counts: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """counts[c] draws from N(μ_c, Σ_c) for every present class, as float32 (features, labels).

        Σ_c is factored by its eigen-decomposition with negative eigenvalues (rounding in the pooled sums)
        clipped to zero, so a singular covariance (fewer samples than dimensions) still samples.
        """
        features, labels = [], []
        for c in torch.nonzero(self.present).flatten().tolist():
            values, vectors = torch.linalg.eigh(self.covariances[c])
            factor = vectors * values.clamp(min=0).sqrt()
            noise = torch.randn(int(counts[c]), len(values), generator=generator, dtype=torch.float64)
            features.append(self.means[c] + noise @ factor.T)
            labels.append(torch.full((int(counts[c]),), c, dtype=torch.int64))
        if not features:
            return torch.zeros(0, self.means.shape[1]), torch.zeros(0, dtype=torch.int64)
        return torch.cat(features).float(), torch.cat(labels)
