"""Random Fourier features for the RBF kernel k(x, y) = exp(−γ‖x − y‖²) (Rahimi & Recht 2007), SFD's Eq. 3.

φ(z) = √(2/D)·[cos(zWᵀ), sin(zWᵀ)] with D/2 frequency rows W ~ N(0, 2γ·I), so ⟨φ(x), φ(y)⟩ ≈ k(x, y) and the
squared distance of two feature means approximates MMD² (Eq. 4). `orthogonal` draws the rows in blocks of
orthonormal directions (QR of a Gaussian matrix) with chi-distributed lengths (Yu et al. 2016), which lowers
the variance of the estimate; it is SFD's default. The official SFD code scales the rows of Q but then uses
its columns as frequencies; we use the textbook construction.

Every silo and the server build the same W from a seed the RoundSpec carries, so W never travels.
"""

from __future__ import annotations

import math

import torch


class RandomFourierFeatures:
    def __init__(self, dim: int, features: int, gamma: float, *, orthogonal: bool, seed: int) -> None:
        if features < 2 or features % 2:
            raise ValueError(f"the number of random features must be even and at least 2, got {features}")
        generator = torch.Generator().manual_seed(seed)
        rows = features // 2
        if orthogonal:
            blocks = []
            for _ in range(math.ceil(rows / dim)):
                q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
                lengths = torch.randn(dim, dim, generator=generator, dtype=torch.float64).norm(dim=1)
                blocks.append(q.T * lengths[:, None])  # rows: orthonormal directions, chi(d) lengths
            directions = torch.cat(blocks)[:rows]
        else:
            directions = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
        self.frequencies = (directions * math.sqrt(2 * gamma)).float()
        self.scale = math.sqrt(2.0 / features)
        self.features = features

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """φ(z), in z's dtype and on its device."""
        projected = z @ self.frequencies.to(z).T
        return self.scale * torch.cat([torch.cos(projected), torch.sin(projected)], dim=-1)
