"""Attack (e): class-presence inference against MFSC's masked class means, beside the census that replaces it.

Threat model (../shared/research/privacy.md §4e): an honest-but-curious aggregator that knows the global model
it sent (encoder F, head W, b), the mask law and the plan's `min_samples` (Kerckhoffs), owns public data the
consortium never trained on, and sees every silo's disclosure (`fedlt.selection.mfsc`): per class, the silo's
mean feature when it holds at least `min_samples` samples of the class, a mask point drawn inside the box of
its real means otherwise. Goal: for each (silo, class), tell a real mean from a mask, i.e. whether the silo
holds the class. Every detector scores each (silo, class) pair, higher meaning more likely real:

- `margin`: the head's margin for the disclosed row's own class, (W m + b)_c − max_{j≠c} (W m + b)_j; a real
  class-c mean is classified as c once the head beats chance, a mask is not aimed at any class.
- `cosine`: cosine of m to the class-c prototype, the mean public feature of class c under F.
- `norm`: −(distance of ‖m‖ to the norms a real mean of class c can have). The silo's count n is unknown but
  at least `min_samples`, and E‖mean of n features‖ falls with n (Jensen) from its bootstrap value at
  n = `min_samples` to ‖prototype‖ as n grows, so the distance is to that interval.
- `clustering`: MFSC's own estimate (`estimate_coverage`) as 0/1: what the method reveals by design.

A logistic-regression combination trained on silos simulated from public data was left out: the single
detectors already separate real means from both masks on the test federation (tests/test_attacks_presence.py).

The hardened alternative is the census (`fedlt.aggregation.tail_guard`): a secure sum that tells the
aggregator how many silos hold each class, never which, so its best per-(silo, class) guess is count/silos
for every silo (`census_scores`). `presence_report` scores both: pooled over all pairs (for the census, that
is the class-prior baseline the note asks for), by class frequency (head, tail), and within each class
across silos, which is what a disclosure reveals about individual silos beyond the counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from attacks.scoring import detection_report
from fedlt.methods.heads import extract_features, head_of
from fedlt.selection import SelectionConfig, estimate_coverage

DETECTORS: tuple[str, ...] = ("margin", "cosine", "norm", "clustering")
BOOTSTRAP_DRAWS = 256


def presence_scores(
    disclosures: Mapping[str, torch.Tensor],
    model: nn.Module,
    public_x: torch.Tensor,
    public_y: torch.Tensor,
    *,
    min_samples: int = SelectionConfig.min_samples,
    separation: float = SelectionConfig.separation,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Each detector's [silos, classes] scores of the disclosures (silos in sorted order); `min_samples` and
    `separation` are the plan's, `seed` fixes the norm test's bootstrap."""
    silos = sorted(disclosures)
    if not silos:
        raise ValueError("no disclosures to score")
    shapes = {tuple(disclosures[s].shape) for s in silos}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"disclosures must all be [classes, features], got shapes {sorted(shapes)}")
    if not (hasattr(model, "encoder") and isinstance(getattr(model, "classifier", None), nn.Linear)):
        raise ValueError("the model must be a SplitModel: an encoder and a linear classifier")
    weight, bias = (t.double() for t in head_of(model))
    classes, dim = next(iter(shapes))
    if classes != len(bias):
        raise ValueError(f"disclosures have {classes} classes, the model's head {len(bias)}")
    if len(public_x) != len(public_y):
        raise ValueError(f"{len(public_x)} public images but {len(public_y)} labels")
    missing = sorted(set(range(classes)) - set(public_y.tolist()))
    if missing:
        raise ValueError(f"public data has no samples of classes {missing}: no prototype for them")
    z = extract_features(model, public_x).double()
    if z.shape[1] != dim:
        raise ValueError(f"disclosures have {dim} features, the model's encoder {z.shape[1]}")

    means = torch.stack([disclosures[s].double() for s in silos])  # [silos, classes, d]
    own = torch.arange(classes)
    logits = means @ weight.T + bias
    rivals = logits.clone()
    rivals[:, own, own] = -math.inf
    prototypes = torch.stack([z[public_y == c].mean(0) for c in range(classes)])
    low, high = _real_norm_range(z, public_y, prototypes, min_samples, seed)
    norms = means.norm(dim=-1)
    coverage = estimate_coverage(disclosures, separation)
    return {
        "margin": (logits[:, own, own] - rivals.max(-1).values).numpy(),
        "cosine": torch.cosine_similarity(means, prototypes[None], dim=-1).numpy(),
        "norm": -((low - norms).clamp_min(0) + (norms - high).clamp_min(0)).numpy(),
        "clustering": torch.stack([coverage[s] for s in silos]).double().numpy(),
    }


def _real_norm_range(
    z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, min_samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class, the [lowest, highest] expected norm of a mean of n ≥ `min_samples` features: ‖prototype‖
    (n → ∞) and the bootstrap mean norm at n = `min_samples`."""
    generator = torch.Generator().manual_seed(seed)
    smallest = []
    for c in range(len(prototypes)):
        members = z[y == c]
        draws = torch.randint(len(members), (BOOTSTRAP_DRAWS, max(1, min_samples)), generator=generator)
        smallest.append(members[draws].mean(1).norm(dim=-1).mean())
    return prototypes.norm(dim=-1), torch.stack(smallest)


def census_scores(holders_per_class: np.ndarray, silos: int) -> np.ndarray:
    """[silos, classes]: the aggregator's best guess from the census alone, count/silos for every silo alike
    (the census says how many silos hold a class, never which)."""
    counts = np.asarray(holders_per_class)
    if silos < 1:
        raise ValueError(f"a census counts at least one silo, got {silos}")
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"census counts are one per class, got shape {counts.shape}")
    if np.any(counts != np.round(counts)) or counts.min() < 0 or counts.max() > silos:
        raise ValueError(f"census counts must be whole numbers in [0, {silos}], got {counts.tolist()}")
    return np.tile(counts.astype(np.float64) / silos, (silos, 1))


def presence_report(
    scores: dict[str, np.ndarray], truth: np.ndarray, *, class_frequency: np.ndarray, tail_below: int
) -> dict:
    """Per detector: `detection_report` over all pairs, over head and tail classes (tail: fewer than
    `tail_below` training samples), and each class's AUC across silos (`class_auc`, NaN where every silo
    or none holds it) with their mean (`within_class_auc`): the per-silo leakage that counts per class
    cannot explain."""
    truth = np.asarray(truth)
    if truth.ndim != 2 or truth.dtype != bool:
        raise ValueError(f"truth must be a boolean [silos, classes] array, got {truth.dtype} {truth.shape}")
    frequency = np.asarray(class_frequency)
    if frequency.shape != (truth.shape[1],):
        raise ValueError(f"class_frequency has shape {frequency.shape}, expected ({truth.shape[1]},)")
    wrong = {name: np.shape(s) for name, s in scores.items() if np.shape(s) != truth.shape}
    if wrong:
        raise ValueError(f"scores must match truth's shape {truth.shape}, got {wrong}")
    tail = frequency < tail_below
    report = {}
    for name, s in scores.items():
        s = np.asarray(s, dtype=np.float64)
        per_class = [detection_report(truth[:, c], s[:, c])["auc"] for c in range(truth.shape[1])]
        judged = [a for a in per_class if not math.isnan(a)]
        report[name] = {
            "all": detection_report(truth.ravel(), s.ravel()),
            "head": detection_report(truth[:, ~tail].ravel(), s[:, ~tail].ravel()),
            "tail": detection_report(truth[:, tail].ravel(), s[:, tail].ravel()),
            "class_auc": per_class,
            "within_class_auc": float(np.mean(judged)) if judged else math.nan,
        }
    return report
