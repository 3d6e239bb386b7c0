"""Feature-to-image inversion through the encoder the attacker holds.

Under plaintext and secagg the aggregator sends the model, so it knows the encoder that turned each record
into its feature z. Given a recovered z (analytic, moment inversion, a synthetic draw), it searches for an
image whose feature matches: the approach of Mahendran and Vedaldi ("Understanding deep image representations
by inverting them", CVPR 2015), minimising the feature loss ‖f(x) − z‖² / ‖z‖² plus a total-variation prior.

The attacker's public data enters as the start of the search: the decoder's image of z (`attacks.decoder`, a
learned inverse as in Dosovitskiy and Brox, "Inverting visual representations with convolutional networks",
CVPR 2016) when the caller passes it, else the public image whose feature is nearest z in cosine. The
encoder fixes most of the image; what it cannot see (pixels that max-pooling and the last layer's null space
ignore) stays near that start, smoothed by the prior.

Deviations from Mahendran and Vedaldi:
* Pixels are x = sigmoid(w), and Adam steps on w at a large step size, instead of momentum descent on x
  under a norm bound: the box [0, 1] holds without clipping, and large steps push pixels to 0 or 1, which
  suits digits (the audit's MNIST-5k model, 200 steps: median SSIM 0.94 at lr 0.5, 0.93 at 0.3, 0.88 at 1).
* TV is the mean absolute difference of neighbouring pixels (their β = 1, as in `attacks.gradinv`), not the
  β = 2 power of their gradient norm; there is no α-norm term, since the sigmoid bounds the pixels.

A feature that is not exact (noised under DP, a synthetic draw) must not be matched exactly: the search
then fits the noise with pixel noise (MNIST-5k, noise of a tenth of the feature's norm: median SSIM 0.66 at
the exact feature's TV weight, the decoder's 0.45). Mahendran and Vedaldi weigh the prior by hand per layer;
here each record's TV weight grows with its feature's noise as `relative_noise` estimates it (0.01 + 0.3 ×
the relative noise, fitted on MNIST-5k: at a relative noise of 0.1, 0.3 and 1.0 the median SSIM is 0.77,
0.56 and 0.37 against the decoder's 0.45, 0.43 and 0.37). Where the noise swamps the feature, as DP's does
on a lone record, the image comes out flat: the release holds no record to draw.

Each record's loss is its own: `k` features are inverted as one batch and no image depends on the others.
Nothing here is random: the same inputs give the same images.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import model_device
from fedlt.methods.heads import extract_features
from fedlt.models import SplitModel

# how far a start's pixels are kept from 0 and 1 before their logit is taken (sigmoid saturates there)
_EDGE = 1e-3
# public images whose features decide whether the encoder ends in a ReLU
RECTIFIED_PROBE = 64


@dataclass(frozen=True)
class FeatureInversionSettings:
    iterations: int = setting(300, ge=1, doc="Adam steps, all images at once")
    lr: float = setting(0.5, gt=0.0, doc="Adam's step size on the images' logits")
    tv_weight: float = setting(1e-2, ge=0.0, doc="weight of the total-variation prior on an exact feature")
    noise_tv: float = setting(
        0.3, ge=0.0, doc="TV weight added per unit of a feature's estimated relative noise (`relative_noise`)"
    )


def invert_features(
    model: SplitModel,
    features: torch.Tensor,
    *,
    public: LabeledData,
    init: np.ndarray | None = None,
    settings: FeatureInversionSettings = FeatureInversionSettings(),
) -> np.ndarray:
    """`k` images, float32 (k, C, H, W) in [0, 1], whose features under `model`'s encoder come nearest the
    rows of `features` (k, d).

    `init` (k, C, H, W) in [0, 1] is where the search starts, best the decoder's images of `features`
    (`attacks.decoder.decode`); without it, each starts at the public image of nearest feature. `public` is
    the attacker's own data, never the target records. The model is not changed (eval mode throughout, its
    mode restored after)."""
    _check(model, features, public, init)
    device = model_device(model)
    z = features.detach().to(device=device, dtype=torch.float32)
    start = _nearest_public(model, z, public) if init is None else torch.as_tensor(init).float()
    tv = torch.full((len(z),), settings.tv_weight, device=device)
    if _rectified(model, public):
        tv = tv + settings.noise_tv * relative_noise(z)
    was_training = model.training
    model.eval()
    try:
        images = _descend(model, z, start.to(device), tv, settings)
    finally:
        model.train(was_training)
    return images.cpu().numpy()


def relative_noise(features: torch.Tensor) -> torch.Tensor:
    """Each row's estimated noise norm over its norm, for features a ReLU ends in: a true one has no negative
    coordinate, so its negative ones are noise, and for noise symmetric about zero their mean square is its
    variance σ² (its norm is then σ·√d). 0 for a feature with no negative coordinate."""
    negative = features.clamp(max=0.0)
    count = (negative < 0).sum(dim=1).clamp(min=1)
    variance = negative.pow(2).sum(dim=1) / count
    tiny = torch.finfo(features.dtype).tiny
    return (variance * features.shape[1]).sqrt() / features.norm(dim=1).clamp(min=tiny)


def _descend(
    model: SplitModel,
    z: torch.Tensor,
    start: torch.Tensor,
    tv: torch.Tensor,
    settings: FeatureInversionSettings,
) -> torch.Tensor:
    """Adam on the logits of the images; the loss is a sum of per-image losses, so Adam's per-coordinate
    steps keep every image's search independent of the others."""
    logits = torch.logit(start.clamp(_EDGE, 1.0 - _EDGE)).requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=settings.lr)
    scale = z.pow(2).sum(dim=1).clamp(min=torch.finfo(z.dtype).tiny)
    for _ in range(settings.iterations):
        images = torch.sigmoid(logits)
        mismatch = (model.encoder(images) - z).pow(2).sum(dim=1) / scale
        objective = (mismatch + tv * _total_variation(images)).sum()
        (logits.grad,) = torch.autograd.grad(objective, [logits])
        optimizer.step()
    return torch.sigmoid(logits).detach()


def _total_variation(images: torch.Tensor) -> torch.Tensor:
    """Each image's mean absolute difference of neighbouring pixels, down and across: digits are mostly
    flat strokes on a flat background."""
    down = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(dim=1)
    across = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(dim=1)
    return down + across


def _rectified(model: SplitModel, public: LabeledData) -> bool:
    """Whether the encoder ends in a ReLU, judged by its features of public images having no negative
    coordinate (`relative_noise` holds only then)."""
    return bool((extract_features(model, torch.from_numpy(public.x[:RECTIFIED_PROBE])) >= 0).all())


def _nearest_public(model: SplitModel, z: torch.Tensor, public: LabeledData) -> torch.Tensor:
    """For each feature, the public image whose feature points most nearly the same way (cosine): its
    direction is what survives clipping and noise best."""
    own = extract_features(model, torch.from_numpy(public.x)).to(z.device, torch.float32)
    similarity = F.normalize(z, dim=1) @ F.normalize(own, dim=1).T
    return torch.from_numpy(public.x)[similarity.argmax(dim=1).cpu()]


def _check(model: SplitModel, features: torch.Tensor, public: LabeledData, init: np.ndarray | None) -> None:
    """Every problem with the inputs at once, as one ValueError naming each."""
    problems = []
    if len(public.input_shape) != 3:
        problems.append(f"public data must be images (N, C, H, W), got samples of shape {public.input_shape}")
    if features.dim() != 2 or len(features) < 1 or features.shape[1] != model.feature_dim:
        problems.append(
            f"features must have shape (k, {model.feature_dim}) with k >= 1, one row per record in the "
            f"model's feature space, got {tuple(features.shape)}"
        )
    elif not bool(torch.isfinite(features).all()):
        problems.append("features hold NaN or infinite values")
    if init is not None:
        expected = (len(features), *public.input_shape)
        if np.shape(init) != expected:
            problems.append(f"init must have shape {expected}, one image per feature, got {np.shape(init)}")
        elif not np.isfinite(init).all():
            problems.append("init holds NaN or infinite values")
    if len(public) == 0:
        problems.append("public is empty: the prior (and, without init, the start) comes from its images")
    if problems:
        raise ValueError("cannot invert features: " + "; ".join(problems))
