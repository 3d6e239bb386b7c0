"""Attack (f): membership inference on the final model — was this record in the training data?

Two attacks, both scoring candidates so that higher means "more likely a member":

* Loss threshold (Yeom, Giacomelli, Fredrikson, Jha, CSF 2018): score = −cross-entropy(x, y). Needs nothing
  but the model; it cannot tell a record the model fits because it memorised it from one that is merely easy.
* LiRA, offline variant (Carlini, Chien, Nasr, Song, Terzis, Tramèr, IEEE S&P 2022, arXiv 2112.03570): shadow
  models trained on random halves of a public pool the attacker owns (they never see the candidates, so every
  shadow is OUT for every candidate) give per-candidate Gaussians N(μ_out, σ²_out) of the logit-scaled
  confidence φ = log(p_y / (1 − p_y)); a candidate is scored by the one-sided test of the target model's φ
  against them. Calibrating by each record's own difficulty is what makes it work at low FPR.

Results are reported as ROC-AUC and TPR at 0.1% and 1% FPR (LiRA's point: the low-FPR regime is where a
membership claim is confident), overall and split into head and tail candidates by how many records of their
class the target trained on, because tail classes are the most exposed (Tobaben et al., arXiv 2402.06674).

What to expect (tests/test_attacks_membership.py): on sklearn digits a small CNN overfitted on 100 records
shows membership in AUC (≈ 0.7) but hardly at low FPR, as near-duplicate handwriting makes non-members look
like members; records it had to memorise (mislabelled ones) are what LiRA finds at 1% FPR and the loss
threshold does not.

Deviations from the paper:

* Sized for CPU: a handful of shadows (default 4, the paper uses up to 256) trained for a few epochs; the
  pool is split into halves, not sampled to the target's training-set size, so a caller wanting matched sizes
  passes a pool twice the target's.
* No test-time augmentation: φ comes from the one un-augmented query (the paper averages over flips/shifts).
* σ_out is one global variance, pooled over candidates around each candidate's own μ_out, below
  `PER_EXAMPLE_VARIANCE_FROM` shadows (the paper recommends a global variance with few shadows; Carlini et
  al.'s reference code takes the spread of all OUT values, which also counts the spread of μ_out between
  candidates); μ_out is the mean over shadows (the reference code takes the median).
* The score is −log of the one-sided p-value, P(Z ≥ φ) for Z ~ N(μ_out, σ²_out): a monotone transform of the
  paper's Λ = 1 − P(Z > φ) that keeps its resolution where Λ rounds to 1, i.e. exactly at low FPR.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import norm
from torch import nn

from attacks.scoring import detection_report
from fedlt.methods import ModelSpec, TrainConfig
from fedlt.methods.local import train_local
from fedlt.seeding import derive_seed, torch_generator

Trainer = Callable[[torch.Tensor, torch.Tensor, int], nn.Module]  # (x, y, seed) -> trained model

MEMBERSHIP_FPRS = (0.001, 0.01)
PER_EXAMPLE_VARIANCE_FROM = 64  # shadows; below, one pooled variance (the paper's advice; our cut-off)
_EVAL_BATCH = 1024
_MIN_STD = 1e-12  # shadows that agree exactly would otherwise divide by zero


def sgd_trainer(spec: ModelSpec, config: TrainConfig) -> Trainer:
    """A `Trainer` that trains like the toolkit's silos do (`train_local`), for target and shadows alike: LiRA
    assumes the attacker can reproduce the target's training recipe."""

    def train(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
        model = spec.build(seed)
        train_local(model, x, y, config, torch_generator(seed, "membership", "train"))
        return model

    return train


def _check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    if y.ndim != 1 or x.ndim < 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"need x (N, ...) and y (N,), got {list(x.shape)}, {list(y.shape)}")


def _labelled_logits(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's float64 logits for x and y as int64 indices into them, both checked."""
    _check_pair(x, y)
    z = _logits(model, x)
    labels = y.long()
    if z.shape[1] < 2:
        raise ValueError("membership scores need a model with at least two classes")
    if labels.numel() and (labels.min() < 0 or labels.max() >= z.shape[1]):
        raise ValueError(f"labels must lie in [0, {z.shape[1]})")
    return z, labels


@torch.no_grad()
def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """float64 logits in eval mode, in batches; the model's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        out = [model(x[i : i + _EVAL_BATCH]) for i in range(0, x.shape[0], _EVAL_BATCH)]
    finally:
        model.train(was_training)
    return torch.cat(out).double()


def logit_confidence(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """φ = log(p_y / (1 − p_y)) per example, computed as z_y − logsumexp_{j≠y} z_j so that it stays finite
    (and exact) when p_y rounds to 0 or 1, where the naive form gives ±inf."""
    z, labels = _labelled_logits(model, x, y)
    true = z.gather(1, labels[:, None]).squeeze(1)
    others = z.scatter(1, labels[:, None], -torch.inf).logsumexp(dim=1)
    return (true - others).numpy()


def loss_threshold_scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """−cross-entropy per example (Yeom et al.): members were fitted, so their loss is lower."""
    z, labels = _labelled_logits(model, x, y)
    return -F.cross_entropy(z, labels, reduction="none").numpy()


def lira_scores_from_confidences(target_phi: np.ndarray, out_phi: np.ndarray) -> np.ndarray:
    """−log P(Z ≥ φ_target), Z ~ N(μ_out, σ²_out) fitted per candidate on `out_phi` of shape (shadows, N).

    The variance is per candidate from `PER_EXAMPLE_VARIANCE_FROM` shadows on, otherwise pooled over
    candidates (each around its own mean), as few shadows estimate one variance per candidate badly."""
    target_phi = np.asarray(target_phi, dtype=np.float64)
    out_phi = np.asarray(out_phi, dtype=np.float64)
    if out_phi.ndim != 2 or out_phi.shape[0] < 2 or out_phi.shape[1:] != target_phi.shape:
        raise ValueError(
            f"need out_phi of shape (shadows >= 2, N) and target_phi of shape (N,), "
            f"got {out_phi.shape} and {target_phi.shape}"
        )
    mu = out_phi.mean(axis=0)
    if out_phi.shape[0] >= PER_EXAMPLE_VARIANCE_FROM:
        sigma = out_phi.std(axis=0, ddof=1)
    else:
        sigma = np.full_like(mu, np.sqrt(((out_phi - mu) ** 2).sum() / (out_phi.size - out_phi.shape[1])))
    return -norm.logsf(target_phi, loc=mu, scale=np.maximum(sigma, _MIN_STD))


def shadow_confidences(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    public_x: torch.Tensor,
    public_y: torch.Tensor,
    train: Trainer,
    shadows: int = 4,
    seed: int = 0,
) -> np.ndarray:
    """φ of each candidate under `shadows` models trained by `train` on random halves of the public pool,
    shape (shadows, N): the OUT samples. Apart from the scoring because shadows are the expensive part and
    serve every target trained by the same recipe."""
    _check_pair(x, y)
    _check_pair(public_x, public_y)
    if shadows < 2:
        raise ValueError(f"LiRA needs at least 2 shadow models to fit a variance, got {shadows}")
    if public_x.shape[1:] != x.shape[1:]:
        raise ValueError(f"public {list(public_x.shape[1:])} differ from candidates {list(x.shape[1:])}")
    half = public_y.shape[0] // 2
    if half < 1:
        raise ValueError("the public pool needs at least 2 records to split into halves")
    out_phi = np.empty((shadows, y.shape[0]))
    for k in range(shadows):
        picked = np.random.default_rng(derive_seed(seed, "lira", "half", k)).permutation(public_y.shape[0])
        idx = torch.from_numpy(picked[:half])
        shadow = train(public_x[idx], public_y[idx], derive_seed(seed, "lira", "shadow", k))
        out_phi[k] = logit_confidence(shadow, x, y)
    return out_phi


def lira_offline_scores(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    public_x: torch.Tensor,
    public_y: torch.Tensor,
    train: Trainer,
    shadows: int = 4,
    seed: int = 0,
) -> np.ndarray:
    """Offline LiRA scores of candidates (x, y) against `model`, higher meaning more likely a member."""
    target_phi = logit_confidence(model, x, y)  # first: bad input fails before any shadow trains
    out_phi = shadow_confidences(
        x, y, public_x=public_x, public_y=public_y, train=train, shadows=shadows, seed=seed
    )
    return lira_scores_from_confidences(target_phi, out_phi)


def membership_report(
    scores: np.ndarray, is_member: np.ndarray, *, class_counts: np.ndarray, y: np.ndarray, tail_below: int
) -> dict:
    """ROC-AUC and TPR at 0.1% and 1% FPR for all candidates, and for head and tail candidates apart: a
    candidate is tail when the target trained on fewer than `tail_below` records of its class."""
    scores = np.asarray(scores, dtype=np.float64)
    is_member = np.asarray(is_member, dtype=bool)
    y = np.asarray(y)
    class_counts = np.asarray(class_counts)
    if not (scores.ndim == is_member.ndim == y.ndim == class_counts.ndim == 1):
        raise ValueError("scores, is_member, y and class_counts must be one-dimensional")
    if not (scores.shape == is_member.shape == y.shape):
        raise ValueError(f"scores {scores.shape}, is_member {is_member.shape}, y {y.shape} differ in length")
    if not np.issubdtype(y.dtype, np.integer) or (y.size and (y.min() < 0 or y.max() >= class_counts.size)):
        raise ValueError(f"labels must be integers indexing class_counts (length {class_counts.size})")
    tail = class_counts[y] < tail_below
    return {
        name: detection_report(is_member[mask], scores[mask], fprs=MEMBERSHIP_FPRS)
        for name, mask in (("all", np.ones_like(tail)), ("head", ~tail), ("tail", tail))
    }
