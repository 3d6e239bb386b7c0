"""DFL-FS stage 2: tail ranks and the two regeneration strategies (re-sampling, weighted covariance)."""

import torch

from fedlt.methods import ModelSpec, TrainConfig
from fedlt.methods.dflfs import DFLFS, DFLFSOptions, tail_rank
from fedlt.methods.feature_stats import ClassGaussians, class_sums

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)


def _method(**options):
    return DFLFS(options=DFLFSOptions(**options), train=TrainConfig(), model=SPEC, rounds=1)


def _gaussians():
    g = torch.Generator().manual_seed(0)
    sizes = [300, 40, 120, 0]  # class 3 absent
    z = torch.cat([torch.randn(n, 3, generator=g) * (c + 1) + 4 * c for c, n in enumerate(sizes)])
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    return ClassGaussians.from_sums(**class_sums(z, y, 4))


def test_tail_rank_runs_from_the_largest_class_to_the_smallest():
    assert tail_rank(torch.tensor([300.0, 40.0, 120.0, 0.0])).tolist() == [0, 2, 1, 3]
    assert tail_rank(torch.tensor([5.0, 5.0, 9.0])).tolist() == [1, 2, 0]  # ties by class index


def test_resampling_draws_n_b_plus_n_k_times_rank_features_per_class():
    z, y = _method(strategy="rs", rs_base=50, rs_growth=30).regenerated(_gaussians(), torch.Generator())
    assert torch.bincount(y, minlength=4).tolist() == [50, 110, 80, 0]  # ranks 0, 2, 1; class 3 absent
    assert z.shape == (240, 3)


def test_weighted_covariance_widens_tail_classes_by_w_b_plus_w_k_times_rank():
    gaussians = _gaussians()
    method = _method(strategy="wc", wc_base=0.5, wc_growth=0.5, per_class=20_000)
    z, y = method.regenerated(gaussians, torch.Generator().manual_seed(1))
    for c, weight in ((0, 0.5), (1, 1.5), (2, 1.0)):
        drawn = torch.cov(z[y == c].double().T)
        # sampling noise of a covariance from 20,000 draws: about 1% of its scale
        assert torch.allclose(
            drawn, weight * gaussians.covariances[c], rtol=0.05, atol=0.05 * weight * (c + 1) ** 2
        )
        assert torch.allclose(z[y == c].double().mean(0), gaussians.means[c], atol=0.1)
