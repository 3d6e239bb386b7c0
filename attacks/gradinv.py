"""Attack (d): gradient inversion of one silo's model delta, as the aggregator of plaintext FedAvg sees it.

Method: Inverting Gradients (Geiping, Bauermeister, Dröge, Moeller, "Inverting Gradients — How easy is it to
break privacy in federated learning?", NeurIPS 2020). Dummy images are optimised so that the gradient of the
model's mean cross-entropy on them points the same way as the observed update: minimise one minus the cosine
similarity between that gradient (taken with `create_graph=True`) and −delta over all parameters at once, plus
a total-variation prior. As in the authors' reference code (`inversefed`): Adam at lr 0.1 on the sign of the
image gradient, images boxed to [0, 1] after every step, the learning rate cut tenfold at 3/8, 5/8 and 7/8 of
the iterations, and of several restarts the one whose gradient matches best. Labels come first, from the last
layer (iDLG, Zhao, Mopuri, Bilen, arXiv 2001.02610).

Calibration: the published results are on the gradient of one record (`record_gradient`). DLG (Zhu, Liu,
Han, NeurIPS 2019) shows single MNIST digits recovered to the pixel on a small sigmoid LeNet; iDLG reads a
single record's label right every time (its Table 1, MNIST: 100 %, DLG 89.9 %); Inverting Gradients recovers
single images recognisably even from trained ResNets on CIFAR-10 and ImageNet (scored by PSNR; its reference
code runs 4,000 to 24,000 iterations with up to 8 restarts). On the audit's model (the FedAvg-trained McMahan
CNN on MNIST-5k, 1.66M parameters) the defaults below reach that: of one record per class, each inverted
from its own gradient with three start seeds, every one comes back at SSIM 0.977 or more (medians
0.992–0.993), labels 10 of 10; the 4 records of `benchmarks/gradinv_calibration.py` score SSIM 0.976–0.996
(PSNR median 39 dB) in 3.2 s each at one thread. Measured against those defaults: TV weight 0.1 lowers the
median to 0.90 and TV 0 leaves one record in ten at 0.94; 200 iterations leave one at 0.93, 100 one at 0.62.

Deviations:
* Sized for CPU: 300 iterations and one restart by default (the reference code runs 4,000 iterations,
  `breaching` 24,000), TV weight 1e-2, images initialised uniform in [0, 1] rather than Gaussian in
  normalised space. That is enough for one record's gradient (above), and more buys nothing on a silo's
  delta: on the audit's smallest silo (196 records, one local epoch), 4 images sought score SSIM 0.40
  against 0.43 for the attacker's own digits, and 4 restarts or 1,200 iterations move that by at most 0.013.
* −delta is treated as proportional to one gradient of the mean loss of the silo's data. That is exact for one
  full-batch SGD step and an approximation for the several mini-batch steps (and epochs) of real local
  training. The paper's multi-step variant instead unrolls the local steps inside the attack, which needs the
  silo's step count and learning rate and takes every step on the full batch; this attack assumes neither.
  The SoK "Gradient Leakage in FL" (arXiv 2404.05403) finds inversion much weaker on multi-step deltas, and
  the audit shows it.
* For more than one record, labels come from a heuristic extension of iDLG (`labels_from_delta`); the
  reference code is given a batch's labels. Pass `labels` to measure the attack with them known.
* The model runs in training mode (on a copy), as local training does; the reference code uses eval mode.
  The two differ only for BatchNorm (ResNet-8).

The reconstructions come back in no particular order: score them with `attacks.scoring.image_report(...,
match=True)`. With many records, best matching lets anything digit-like beat random noise; the tests compare
with unrelated real images as well.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedlt.config import setting


@dataclass(frozen=True)
class InversionSettings:
    iterations: int = setting(300, ge=1, doc="Adam steps per restart")
    lr: float = setting(0.1, gt=0.0)
    tv_weight: float = setting(1e-2, ge=0.0, doc="weight of the total-variation prior")
    restarts: int = setting(1, ge=1, doc="independent starts; the best gradient match is kept")


def labels_from_delta(model: nn.Module, delta: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """`count` labels (int64, sorted) for the records behind `delta`, read off the last layer.

    The rule: score each class by the row sum of the delta of the last two-dimensional parameter (the
    classifier weight). For one record and one step the gradient's row j is (p_j − 1[j = y])·z with z ≥ 0
    post-ReLU, so only the label's row sum is negative, and only its delta row sum positive: iDLG exactly. For
    `count` records, the classes with a positive score are taken as present: if there are at least `count`,
    the `count` highest; otherwise each gets one record and the rest are shared out in proportion to the
    positive scores (largest remainder). That extension is a heuristic: with many records of balanced classes
    the scores mostly reflect how far the model's predictions are off, and counts come out rough.
    """
    params = _checked(model, delta, count)
    last = max(i for i, p in enumerate(params) if p.dim() == 2)
    score = delta[last].detach().double().sum(dim=1)
    order = torch.argsort(score, descending=True, stable=True)
    present = int((score > 0).sum())
    if present == 0:
        raise ValueError("the classifier's delta has no positive row sum, so it carries no label signal")
    if count <= present:
        return torch.sort(order[:count]).values
    positive = score.clamp(min=0.0)
    share = (count - present) * positive / positive.sum()
    records = (score > 0).long() + share.floor().long()
    left = count - int(records.sum())
    records[torch.argsort(share - share.floor(), descending=True, stable=True)[:left]] += 1
    return torch.repeat_interleave(torch.arange(len(score)), records)


def invert_delta(
    model: nn.Module,
    delta: Sequence[torch.Tensor],
    *,
    count: int,
    image_shape: tuple[int, int, int],
    labels: torch.Tensor | None = None,
    settings: InversionSettings = InversionSettings(),
    seed: int = 0,
) -> np.ndarray:
    """`count` images, float32 (count, C, H, W) in [0, 1], whose loss gradient on `model` best matches −delta.

    `model` is the global model the silo received, before its training; `delta` is its update (after − before)
    in `model.parameters()` order. The model is not changed: the attack works on a copy in training mode,
    the mode local training ran in (it matters for BatchNorm)."""
    params = _checked(model, delta, count)
    if labels is None:
        labels = labels_from_delta(model, delta, count)
    labels = torch.as_tensor(labels, dtype=torch.int64)
    if labels.shape != (count,):
        raise ValueError(f"labels must have shape ({count},) to match count, got {tuple(labels.shape)}")
    target = [-d.detach().to(p.dtype) for d, p in zip(delta, params, strict=True)]
    if not any(t.any() for t in target):
        raise ValueError("the delta is zero everywhere: the silo did not move the model")
    replica = copy.deepcopy(model).train().requires_grad_(True)
    generator = torch.Generator().manual_seed(seed)
    best, best_distance = None, math.inf
    for _ in range(settings.restarts):
        start = torch.rand((count, *image_shape), generator=generator)
        images = _descend(replica, target, labels, start, settings)
        distance = float(_distance(replica, target, images, labels, create_graph=False))
        if best is None or distance < best_distance:
            best, best_distance = images, distance
    return best.numpy()


def record_gradient(model: nn.Module, x: np.ndarray | torch.Tensor, y: int) -> list[torch.Tensor]:
    """The update a one-record batch makes, as a delta in `model.parameters()` order: minus the gradient of
    the cross-entropy of record `x` (C, H, W) with label `y` on `model`. One SGD step at learning rate lr
    sends lr times this; `invert_delta`'s cosine objective is blind to that scale, so lr is left out. This is
    the papers' calibration case (the plaintext gradient of a single record), which every other view of
    the update only blurs. The model is not changed: the gradient is taken on a copy in training mode."""
    x = torch.as_tensor(x, dtype=torch.float32)
    if x.dim() != 3:
        raise ValueError(f"x must be one record of shape (C, H, W), got shape {tuple(x.shape)}")
    replica = copy.deepcopy(model).train().requires_grad_(True)
    loss = F.cross_entropy(replica(x[None]), torch.tensor([int(y)]))
    return [-g for g in torch.autograd.grad(loss, list(replica.parameters()))]


def calibration_records(labels: np.ndarray, count: int, *, seed: int) -> np.ndarray:
    """Indices of `count` records of distinct classes (classes, then one record of each, drawn by `seed`),
    sorted: the records whose one-record gradients calibrate the attack. Distinct classes, so that the
    calibration covers several shapes of digit, not one class's shape several times."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if not 1 <= count <= len(classes):
        raise ValueError(f"count must be between 1 and the {len(classes)} classes present, got {count}")
    rng = np.random.default_rng(seed)
    picked = rng.choice(classes, count, replace=False)
    return np.sort([int(rng.choice(np.flatnonzero(labels == c))) for c in picked])


def delta_mismatch(
    model: nn.Module, delta: Sequence[torch.Tensor], images: np.ndarray, labels: torch.Tensor
) -> float:
    """How badly (images, labels) explain `delta` by the attack's own objective: 0 when their gradient on
    `model` points exactly along −delta, 1 when orthogonal. Lets an audit tell a failed search from a match
    that is not the silo's data."""
    _checked(model, delta, len(images))
    replica = copy.deepcopy(model).train().requires_grad_(True)
    target = [-d.detach() for d in delta]
    x = torch.as_tensor(images, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.int64)
    return float(_distance(replica, target, x, y, create_graph=False))


def _distance(
    model: nn.Module,
    target: Sequence[torch.Tensor],
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    create_graph: bool,
) -> torch.Tensor:
    """One minus the cosine similarity of the mean-loss gradient on (images, labels) and `target`, over all
    parameters as one vector: the paper's objective, blind to the unknown step size that scales a delta."""
    params = list(model.parameters())
    loss = F.cross_entropy(model(images), labels)
    grads = torch.autograd.grad(loss, params, create_graph=create_graph)
    dot = sum((g * t).sum() for g, t in zip(grads, target, strict=True))
    norms = sum(g.pow(2).sum() for g in grads).sqrt() * sum(t.pow(2).sum() for t in target).sqrt()
    return 1.0 - dot / norms.clamp(min=torch.finfo(norms.dtype).tiny)


def _total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels, down and across: natural images are mostly smooth."""
    down = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    across = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return down + across


def _descend(
    model: nn.Module,
    target: Sequence[torch.Tensor],
    labels: torch.Tensor,
    start: torch.Tensor,
    settings: InversionSettings,
) -> torch.Tensor:
    """One restart: signed Adam steps, boxed to [0, 1] after each, as the paper's reference code does."""
    images = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([images], lr=settings.lr)
    n = settings.iterations
    milestones = [3 * n // 8, 5 * n // 8, 7 * n // 8]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    for _ in range(n):
        objective = _distance(model, target, images, labels, create_graph=True)
        objective = objective + settings.tv_weight * _total_variation(images)
        (step,) = torch.autograd.grad(objective, images)
        images.grad = step.sign()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            images.clamp_(0.0, 1.0)
    return images.detach()


def _checked(model: nn.Module, delta: Sequence[torch.Tensor], count: int) -> list[nn.Parameter]:
    """The model's parameters, once `delta` is known to line up with them and `count` to be usable."""
    if count < 1:
        raise ValueError(f"count must be at least 1 record, got {count}")
    params = list(model.parameters())
    if len(delta) != len(params):
        raise ValueError(
            f"delta has {len(delta)} tensors but the model has {len(params)} parameters; "
            "pass one tensor per parameter, in model.parameters() order"
        )
    for i, (d, p) in enumerate(zip(delta, params, strict=True)):
        if tuple(d.shape) != tuple(p.shape):
            raise ValueError(f"delta[{i}] has shape {tuple(d.shape)}, its parameter {tuple(p.shape)}")
    return params
