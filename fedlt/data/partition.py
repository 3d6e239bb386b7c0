"""Label-skewed (non-IID) partition of a dataset over silos by per-class Dirichlet(α) proportions."""

from __future__ import annotations

import numpy as np

from fedlt.errors import FedltError


class PartitionError(FedltError):
    """No partition satisfies the requested minimum silo size."""


def dirichlet_partition(
    labels: np.ndarray,
    *,
    num_silos: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Every sample index in exactly one silo; class c is split by proportions p_c ~ Dir(α·1_K).

    Small α concentrates each class on few silos. Draws are repeated until every silo holds at least
    `min_size` samples (the usual guard, e.g. FedML's `min_size` loop), so no silo trains on nothing.
    """
    if num_silos < 1 or alpha <= 0:
        raise ValueError(f"need num_silos >= 1 and alpha > 0, got {num_silos} and {alpha}")
    if len(labels) < num_silos * min_size:
        raise PartitionError(f"{len(labels)} samples cannot give {num_silos} silos at least {min_size} each")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            counts = _largest_remainder(len(idx), rng.dirichlet(np.full(num_silos, alpha)))
            for silo, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
                parts[silo].append(chunk)
        silos = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in silos) >= min_size:
            return silos
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) partition over {num_silos} silos gave every silo "
        f">= {min_size} samples in {max_tries} draws; raise alpha or lower min_silo_size"
    )


def label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each silo's label distribution and the pooled one (0 = IID)."""
    num_classes = int(labels.max()) + 1
    pooled = np.bincount(labels, minlength=num_classes) / len(labels)
    tv = [
        0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - pooled).sum()
        for p in parts
        if len(p)
    ]
    return float(np.mean(tv))


def _largest_remainder(total: int, proportions: np.ndarray) -> np.ndarray:
    """Integer counts summing to `total` that follow `proportions` as closely as integers can."""
    exact = proportions * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
    return counts
