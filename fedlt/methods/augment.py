"""Random translations of a batch of images, for local training on classes with a handful of records."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shift_pixels(x: torch.Tensor, fraction: float) -> int:
    """The largest move for images like `x` (N, C, H, W): `fraction` of the shorter side, rounded (2 pixels
    of MNIST's 28 at 0.07, 1 of the 8 of sklearn's digits); 0 for table rows (N, F), which have no pixels
    to move."""
    return round(fraction * min(x.shape[-2:])) if x.ndim == 4 else 0


def random_shift(x: torch.Tensor, limit: int, generator: torch.Generator) -> torch.Tensor:
    """Each image of `x` (N, C, H, W) moved by its own whole-pixel offset in [-limit, limit] on both axes,
    the uncovered border filled with zeros (the datasets' background)."""
    if limit == 0:
        return x
    n, _, height, width = x.shape
    padded = F.pad(x, (limit, limit, limit, limit))
    dy, dx = torch.randint(0, 2 * limit + 1, (2, n), generator=generator)
    rows = dy[:, None] + torch.arange(height)
    cols = dx[:, None] + torch.arange(width)
    moved = padded[torch.arange(n)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return moved.permute(0, 3, 1, 2)
