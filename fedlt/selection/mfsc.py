"""Masked feature-statistics clustering (MFSC, DFL-FS stage 1): which silo holds which class, estimated from
per-silo class means in which every class a silo lacks is replaced by a random point.

This is a per-silo **disclosure**, not a sum: the aggregator sees each picked silo's real class means. The
mask hides *which* rows are real only as far as clustering cannot tell them apart; the aggregator's estimate
of every silo's class coverage is the point of the method, so coverage is disclosed too (docs/operator.md).

Where the paper (Sec. 3.2) leaves the algorithm open, this module decides, and says so:
- Means are taken with the encoder of the global model the silo received, before local training, so that
  all means disclosed in one round live in one feature space (the paper does not say which model).
- Clustering: a class mean counts as real when another silo's mean of the same class lies close to it. Real
  means of a class from different silos cluster; mask points are far from everything. "Close" is the
  threshold that splits the log nearest-neighbour distances into two modes (Otsu); if the modes are not at
  least `separation` times apart, there is no mask to find and every mean counts as real. A class held by
  one silo alone therefore reads as missing: nothing corroborates it.
- Masks (`mask`): `gaussian` draws each coordinate from the silo's own feature mean and spread, `uniform`
  between its own feature minimum and maximum, `permuted` shuffles the coordinates of one of its real class
  means (the same values, so the same norm and sparsity as a real mean, in no class's direction).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedlt.data.arrays import LabeledImages
from fedlt.methods import GlobalState, Method, SiloContext
from fedlt.methods.heads import extract_features
from fedlt.selection.config import MASKS

DISCLOSURE = "mfsc"


def masked_class_means(
    z: torch.Tensor, y: torch.Tensor, num_classes: int, mask: str, gen: torch.Generator
) -> torch.Tensor:
    """[classes, features]: the mean feature of each class held, a `mask` point for each class not held."""
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; known: {', '.join(MASKS)}")
    z = z.double()
    counts = torch.bincount(y, minlength=num_classes)
    means = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
    means.index_add_(0, y, z)
    held = counts > 0
    means[held] /= counts[held].unsqueeze(1)
    missing = int((~held).sum())
    if missing:
        means[~held] = _mask_points(z, means[held], missing, mask, gen)
    return means


def _mask_points(
    z: torch.Tensor, real: torch.Tensor, k: int, mask: str, gen: torch.Generator
) -> torch.Tensor:
    d = z.shape[1]
    if mask == "gaussian":
        return z.mean(0) + z.std(0, correction=0) * torch.randn(k, d, generator=gen, dtype=z.dtype)
    if mask == "uniform":
        low, high = z.min(0).values, z.max(0).values
        return low + (high - low) * torch.rand(k, d, generator=gen, dtype=z.dtype)
    rows = real[torch.randint(len(real), (k,), generator=gen)]
    order = torch.rand(k, d, generator=gen).argsort(dim=1)
    return rows.gather(1, order)


def class_mean_disclosure(
    method: Method, state: GlobalState, data: LabeledImages, ctx: SiloContext, mask: str
) -> torch.Tensor:
    """What a picked silo discloses: its masked class means under the received global encoder."""
    z = extract_features(method.load(state.model), torch.from_numpy(data.x))
    y = torch.from_numpy(data.y)
    return masked_class_means(z, y, method.model_spec.num_classes, mask, ctx.generator("mfsc-mask"))


def estimate_coverage(disclosures: Mapping[str, torch.Tensor], separation: float) -> dict[str, torch.Tensor]:
    """Per silo, a boolean [classes] vector: which classes its disclosed means say it holds."""
    silos = sorted(disclosures)
    if len(silos) < 2:  # nothing to corroborate against
        return {s: torch.ones(len(disclosures[s]), dtype=torch.bool) for s in silos}
    points = torch.stack([disclosures[s].double() for s in silos]).transpose(0, 1)  # [classes, silos, d]
    distances = torch.cdist(points, points)
    distances.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    nearest = distances.min(dim=2).values  # [classes, silos]
    log_nearest = torch.log(nearest.clamp_min(1e-12)).numpy()
    threshold = _two_mode_split(log_nearest.ravel(), np.log(separation))
    holds = torch.from_numpy(log_nearest <= threshold)
    return {s: holds[:, i] for i, s in enumerate(silos)}


def _two_mode_split(values: np.ndarray, min_gap: float) -> float:
    """Otsu's split between two modes, placed mid-gap; +inf when the modes are closer than `min_gap`."""
    from skimage.filters import threshold_otsu

    levels = np.unique(values)
    if len(levels) < 2:
        return float("inf")
    # one bin per distinct value, so the split falls exactly between two of them
    split = float(threshold_otsu(hist=(np.ones(len(levels)), levels)))
    low, high = values[values <= split], values[values > split]
    if high.mean() - low.mean() < min_gap:
        return float("inf")
    return (low.max() + high.min()) / 2
