"""The audit's scores: golden values for the image metrics and the detection rates."""

import math

import numpy as np
import pytest

from attacks.scoring import PSNR_CAP, best_match, detection_report, image_report, per_image, tpr_at_fpr


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 28, 28))


def test_identical_images_score_perfectly_and_random_ones_do_not():
    """Guards the metric conventions (data_range 1, capped PSNR): identical images give SSIM 1, PSNR at the
    cap and MAE 0; random images against them score near SSIM 0."""
    x = _images(4, 0)
    scores = per_image(x, x)
    np.testing.assert_allclose(scores["ssim"], 1.0)
    np.testing.assert_allclose(scores["psnr"], PSNR_CAP)
    np.testing.assert_allclose(scores["mae"], 0.0)
    report = image_report(x, x, seed=1)
    assert abs(report["ssim"]["random"]["median"]) < 0.1


def test_psnr_of_a_constant_shift_is_its_closed_form():
    """Guards data_range = 1.0: an image against itself plus c has PSNR −20·log10(c) exactly."""
    x = np.full((1, 1, 8, 8), 0.25)
    for c in (0.1, 0.02):
        assert per_image(x, x + c)["psnr"][0] == pytest.approx(-20 * math.log10(c), rel=1e-9)


def test_best_match_undoes_a_permutation():
    """Guards scoring without a one-to-one order: shuffled reconstructions are paired back by SSIM, and
    fewer reconstructions than originals each meet the original they came from."""
    x = _images(5, 2)
    shuffled = x[[3, 0, 4, 1, 2]]
    paired, found = best_match(x, shuffled)
    np.testing.assert_array_equal(paired, found)
    few, three = best_match(x, x[[4, 1]])  # fewer reconstructions: each meets its own original
    np.testing.assert_array_equal(few, three)
    assert image_report(x, shuffled, seed=0, match=True)["ssim"]["attack"]["median"] == pytest.approx(1.0)


def test_detection_rates_on_a_known_ranking():
    """Guards AUC and TPR at a fixed FPR: a perfect ranking gives AUC 1 and TPR 1 at 1% FPR; with the top
    negative above every positive, AUC drops to 0.99, TPR at 1% FPR of 100 negatives stays 1 (one false
    positive is allowed) and TPR at 0.5% FPR drops to 0."""
    labels = np.array([1] * 10 + [0] * 100, dtype=bool)
    scores = np.concatenate([np.linspace(2, 3, 10), np.linspace(0, 1, 100)])
    assert detection_report(labels, scores)["auc"] == 1.0
    assert tpr_at_fpr(labels, scores, 0.01) == 1.0
    scores[-1] = 10.0  # one negative above every positive
    report = detection_report(labels, scores)
    assert report["auc"] == pytest.approx(0.99)
    assert report["tpr_at_1%_fpr"] == 1.0  # 1 false positive of 100 is still within 1%
    assert tpr_at_fpr(labels, scores, 0.005) == 0.0
    assert math.isnan(detection_report(np.ones(3, dtype=bool), np.arange(3.0))["auc"])
