"""Masked feature-statistics clustering (MFSC, DFL-FS stage 1): which silo holds which class, estimated from
per-silo class means in which every class a silo lacks is replaced by a random point.

This is a per-silo **disclosure**, not a sum: the aggregator sees every asked silo's real class means. The
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
- Masks (`mask`) stay inside the box of the silo's own real class means, so a sign or range test does not
  find them (means of ReLU features are never negative): `uniform` draws each coordinate between the
  smallest and largest value of that coordinate over the real means, `gaussian` from their mean and spread
  truncated to that range. A silo holding one class uses its per-sample features instead, so masks are not
  copies of its one mean. (Random convex combinations of the real means were tried as a third mask and
  dropped: they land near real class means often enough that clustering misreads coverage.)
- Mask randomness is a ChaCha20 keystream keyed by a secret that never leaves the silo (`mask_stream`):
  were it derived from the RoundSpec's seed, or drawn from a statistical generator whose state a few outputs
  reveal, the aggregator could regenerate every mask and read coverage off exactly.
- A class a silo holds fewer than `min_samples` samples of is disclosed as a mask, not as its mean: the
  aggregator chooses the encoder, and an encoder close to the identity turns a one-sample class mean into
  that sample (silos enforce their own minimum, `policy.disclosure_min_samples`, on top of the plan's).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedlt.data.arrays import LabeledData
from fedlt.methods import GlobalState, Method
from fedlt.methods.heads import extract_features
from fedlt.seeding import derive_seed
from fedlt.selection.config import MASKS

DISCLOSURE = "mfsc"


class MaskStream:
    """Uniform draws in [0, 1) from a ChaCha20 keystream: unpredictable and unrepeatable without the key."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"a mask key has 32 bytes, got {len(key)}")
        self._keystream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def uniform(self, *shape: int) -> torch.Tensor:
        words = np.frombuffer(self._keystream.update(bytes(8 * math.prod(shape))), dtype="<u8")
        return torch.from_numpy((words >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(shape)


def masked_class_means(
    z: torch.Tensor, y: torch.Tensor, num_classes: int, mask: str, stream: MaskStream, *, min_samples: int = 1
) -> torch.Tensor:
    """[classes, features]: the mean feature of each class held by at least `min_samples` samples, a `mask`
    point for every other class."""
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; known: {', '.join(MASKS)}")
    z = z.double()
    counts = torch.bincount(y, minlength=num_classes)
    means = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
    means.index_add_(0, y, z)
    held = counts >= max(1, min_samples)
    means[held] /= counts[held].unsqueeze(1)
    missing = int((~held).sum())
    if missing:
        reference = means[held] if int(held.sum()) >= 2 else z[held[y]] if held.any() else z
        means[~held] = _mask_points(reference, missing, mask, stream)
    return means


def _mask_points(reference: torch.Tensor, k: int, mask: str, stream: MaskStream) -> torch.Tensor:
    low, high = reference.min(0).values, reference.max(0).values
    if mask == "uniform":
        return low + (high - low) * stream.uniform(k, len(low))
    mean, spread = reference.mean(0), reference.std(0, correction=0).clamp_min(1e-12)  # gaussian, truncated
    cdf_low = torch.special.ndtr((low - mean) / spread)
    cdf_high = torch.special.ndtr((high - mean) / spread)
    u = cdf_low + (cdf_high - cdf_low) * stream.uniform(k, len(low))
    return (mean + spread * torch.special.ndtri(u)).clamp(low, high)  # clamp: rounding at the edges


def mask_stream(secret: bytes, state: str) -> MaskStream:
    """The mask draws for one state (its content digest), keyed by the silo's secret: the same whatever round
    or attempt the aggregator labels the state with, so a relabelled state gets the same disclosure, and two
    disclosures never show the class means beside two different sets of mask points."""
    key = hmac.new(secret, b"fedlt/mfsc-mask/v2/" + state.encode(), "sha256").digest()
    return MaskStream(key)


def simulated_mask_secret(seed: int, silo_id: str) -> bytes:
    """The simulator's stand-in for a silo's mask secret (a simulation has no party to keep one from)."""
    return derive_seed(seed, "mfsc-mask-secret", silo_id).to_bytes(8, "little")


def class_mean_disclosure(
    method: Method,
    state: GlobalState,
    data: LabeledData,
    mask: str,
    stream: MaskStream,
    *,
    min_samples: int,
) -> torch.Tensor:
    """What a silo discloses: its masked class means under the received global encoder."""
    z = extract_features(method.load(state.model), torch.from_numpy(data.x))
    y = torch.from_numpy(data.y)
    return masked_class_means(z, y, method.model_spec.num_classes, mask, stream, min_samples=min_samples)


def estimate_coverage(disclosures: Mapping[str, torch.Tensor], separation: float) -> dict[str, torch.Tensor]:
    """Per silo, a boolean [classes] vector: which classes its disclosed means say it holds."""
    silos = sorted(disclosures)
    if len(silos) < 2:  # nothing to corroborate against
        return {s: torch.ones(len(disclosures[s]), dtype=torch.bool) for s in silos}
    points = torch.stack([disclosures[s].double() for s in silos]).transpose(0, 1)  # [classes, silos, d]
    distances = torch.cdist(points, points)
    distances.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    nearest = distances.min(dim=2).values  # [classes, silos]
    # an identical mean elsewhere (two silos with the same data) corroborates; its log distance, -inf, is
    # kept out of the split it would otherwise dominate
    identical = (nearest == 0).numpy()
    log_nearest = torch.log(nearest).numpy()
    threshold = _two_mode_split(log_nearest[~identical], np.log(separation))
    holds = torch.from_numpy(identical | (log_nearest <= threshold))
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
