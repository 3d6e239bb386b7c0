"""How an audit scores what an attack recovered: image similarity and detection rates.

Images follow the conventions of `../shared/research/privacy.md` §5: float64 in [0, 1], scored per image with
scikit-image (`structural_similarity` with Wang et al.'s Gaussian window, `data_range=1.0`; PSNR with
`data_range=1.0`, capped at 100 dB for identical images; MAE), then summarised by mean, median and IQR.
Every image score comes with the same score of random images against the same originals (the baseline an
attack must beat to have recovered anything), and, where reconstructions are not in the originals' order, with
the best one-to-one match (Hungarian assignment on SSIM).

Detection attacks (class presence, membership) are scored by ROC-AUC and the TPR at a fixed low FPR, read off
the ROC curve (scikit-learn), the way LiRA reports them.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from sklearn.metrics import roc_auc_score, roc_curve

PSNR_CAP = 100.0  # dB, for an exact reconstruction (MSE 0)
IMAGE_METRICS = ("ssim", "psnr", "mae")


def as_images(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) or (N, H, W) arrays as (N, H, W, C) float64 clipped to [0, 1]."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise ValueError(f"images are (N, C, H, W) or (N, H, W), got shape {x.shape}")
    return np.clip(np.moveaxis(x, 1, -1), 0.0, 1.0)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Wang et al.'s SSIM of two (H, W, C) images in [0, 1]: a Gaussian window of σ = 1.5 (11 taps), narrowed
    on smaller images so that its taps (scikit-image takes 2·⌊3.5σ + ½⌋ + 1) fit, 7 taps for 8×8 digits."""
    side = min(a.shape[0], a.shape[1])
    window = min(11, side if side % 2 else side - 1)
    return float(
        structural_similarity(
            a,
            b,
            data_range=1.0,
            channel_axis=-1,
            gaussian_weights=True,
            sigma=1.5 if window == 11 else (window // 2) / 3.5,
            use_sample_covariance=False,
            win_size=window,
        )
    )


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    if np.array_equal(a, b):
        return PSNR_CAP
    return min(float(peak_signal_noise_ratio(a, b, data_range=1.0)), PSNR_CAP)


def mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(a - b)))


SCORERS = {"ssim": ssim, "psnr": psnr, "mae": mae}


def per_image(originals: np.ndarray, reconstructions: np.ndarray) -> dict[str, np.ndarray]:
    """Each metric of each reconstruction against the original at the same index."""
    a, b = as_images(originals), as_images(reconstructions)
    if a.shape != b.shape:
        raise ValueError(f"originals {a.shape} and reconstructions {b.shape} differ in shape")
    return {name: np.array([f(x, y) for x, y in zip(a, b, strict=True)]) for name, f in SCORERS.items()}


def best_match(originals: np.ndarray, reconstructions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Originals and reconstructions paired one to one so that the total SSIM is largest (Hungarian); when
    one set is larger, only as many pairs as the smaller set has are formed."""
    a, b = as_images(originals), as_images(reconstructions)
    similarity = np.array([[ssim(x, y) for y in b] for x in a])
    rows, cols = linear_sum_assignment(-similarity)
    return np.asarray(originals)[rows], np.asarray(reconstructions)[cols]


def summary(values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {"mean": math.nan, "median": math.nan, "iqr": math.nan, "n": 0}
    q1, q3 = np.percentile(values, [25, 75])
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "iqr": float(q3 - q1),
        "n": int(values.size),
    }


def random_images(like: np.ndarray, seed: int) -> np.ndarray:
    """Uniform noise images of the originals' shape: the baseline every reconstruction is compared with."""
    return np.random.default_rng(seed).random(np.shape(like))


def image_report(
    originals: np.ndarray, reconstructions: np.ndarray, *, seed: int, match: bool = False
) -> dict[str, dict]:
    """Summaries of SSIM, PSNR and MAE for the reconstructions and for random images against the same
    originals; `match` first pairs reconstructions with originals one to one by SSIM (`best_match`)."""
    if match:
        originals, reconstructions = best_match(originals, reconstructions)
    found = per_image(originals, reconstructions)
    baseline = per_image(originals, random_images(originals, seed))
    return {
        name: {"attack": summary(found[name]), "random": summary(baseline[name])} for name in IMAGE_METRICS
    }


def tpr_at_fpr(labels: np.ndarray, scores: np.ndarray, fpr: float) -> float:
    """The largest TPR at an FPR of at most `fpr` on the ROC of `scores` (higher: more likely positive)."""
    false_pos, true_pos, _ = roc_curve(labels, scores)
    allowed = false_pos <= fpr
    return float(true_pos[allowed].max()) if allowed.any() else 0.0


def detection_report(labels: np.ndarray, scores: np.ndarray, *, fprs: tuple[float, ...] = (0.01,)) -> dict:
    """ROC-AUC and TPR at each FPR in `fprs`; AUC is NaN when only one class of label is present."""
    labels = np.asarray(labels, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.all() or not labels.any():
        return {"auc": math.nan, **{_tpr_key(f): math.nan for f in fprs}, "positives": int(labels.sum())}
    return {
        "auc": float(roc_auc_score(labels, scores)),
        **{_tpr_key(f): tpr_at_fpr(labels, scores, f) for f in fprs},
        "positives": int(labels.sum()),
        "negatives": int((~labels).sum()),
    }


def _tpr_key(fpr: float) -> str:
    return f"tpr_at_{fpr * 100:g}%_fpr"
