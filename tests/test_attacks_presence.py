"""Attack (e): class presence read off MFSC's masked class means, per mask, against the census alternative.

The federation is digits split long-tailed over 8 silos; the aggregator's public data is the balanced test
split, which no silo trains on. The global model is a small CNN trained for a few epochs on the pooled silo
data: a stand-in for FedAvg's model after some rounds, with a head well above chance (≈ 0.8 accuracy), since
the margin detector needs one (an untrained encoder already gives the cosine detector AUC 1.0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attacks.presence import DETECTORS, census_scores, presence_report, presence_scores
from fedlt.data.federation import DataConfig, Federation, build_federation
from fedlt.methods import ModelSpec, TrainConfig
from fedlt.methods.heads import extract_features
from fedlt.methods.local import train_local
from fedlt.models import SplitModel
from fedlt.seeding import torch_generator
from fedlt.selection import MASKS, SelectionConfig, mask_stream, masked_class_means, simulated_mask_secret

SEED, SILOS, CLASSES = 0, 8, 10
MIN_SAMPLES = SelectionConfig.min_samples
RECIPE = DataConfig(
    dataset="digits", imbalance=10.0, alpha=0.5, silos=SILOS, min_silo_size=10, test_per_class=30
)
TAIL_BELOW = 50  # training samples: classes 5–9 of the digits long tail (40 down to 14 samples)
NAMES = [f"silo-{k}" for k in range(SILOS)]  # single digits: sorted order is index order


@pytest.fixture(scope="module")
def world() -> tuple[Federation, SplitModel]:
    """The federation and a briefly trained global model, on one thread (deterministic, and the machine's
    other cores stay free)."""
    fed = build_federation(RECIPE, seed=SEED)
    model = ModelSpec("cnn-small", fed.test.input_shape, CLASSES).build(SEED)
    x = torch.from_numpy(np.concatenate([s.x for s in fed.silos]))
    y = torch.from_numpy(np.concatenate([s.y for s in fed.silos]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train = TrainConfig(local_epochs=6, batch_size=32, lr=0.05, momentum=0.9)
        train_local(model, x, y, train, torch_generator(SEED, "global-model"))
    finally:
        torch.set_num_threads(threads)
    return fed, model


def disclosures(fed: Federation, model: SplitModel, mask: str) -> dict[str, torch.Tensor]:
    """What every silo discloses in round 1, as `fedlt.selection.mfsc.class_mean_disclosure` computes it."""
    return {
        name: masked_class_means(
            extract_features(model, torch.from_numpy(silo.x)),
            torch.from_numpy(silo.y),
            CLASSES,
            mask,
            mask_stream(simulated_mask_secret(SEED, name), "round-1"),
            min_samples=MIN_SAMPLES,
        )
        for name, silo in zip(NAMES, fed.silos, strict=True)
    }


def holdings(fed: Federation) -> np.ndarray:
    """[silos, classes]: which rows of each disclosure are real means."""
    return np.stack([silo.class_counts() >= MIN_SAMPLES for silo in fed.silos])


def report(fed: Federation, scores: dict[str, np.ndarray]) -> dict:
    return presence_report(scores, holdings(fed), class_frequency=fed.train_counts, tail_below=TAIL_BELOW)


@pytest.mark.parametrize("mask", MASKS)
def test_mfsc_disclosures_reveal_which_silo_holds_which_class(world, mask):
    """Guards the audit's finding: under either mask a detector tells real means from masks, tail included."""
    fed, model = world
    public_x, public_y = torch.from_numpy(fed.test.x), torch.from_numpy(fed.test.y)
    truth = holdings(fed)
    assert 0 < truth.sum() < truth.size
    scores = presence_scores(disclosures(fed, model, mask), model, public_x, public_y)
    assert set(scores) == set(DETECTORS)
    found = report(fed, scores)
    for key in ("all", "head", "tail"):
        assert max(found[d][key]["auc"] for d in DETECTORS) >= 0.95, (key, found)
    assert max(found[d]["within_class_auc"] for d in DETECTORS) >= 0.95
    assert max(found[d]["all"]["tpr_at_1%_fpr"] for d in DETECTORS) >= 0.5
    # the head knows the classes: real class-c means are classified as c
    assert found["margin"]["all"]["auc"] >= 0.9


def test_the_census_leaves_nothing_to_tell_silos_apart(world):
    """Guards the hardened alternative: one guess per class for every silo, so each class's AUC is 0.5."""
    fed, _ = world
    truth = holdings(fed)
    guess = census_scores(truth.sum(axis=0), SILOS)
    assert guess.shape == (SILOS, CLASSES)
    assert (guess == guess[0]).all()
    found = report(fed, {"census": guess})["census"]
    judged = [a for a in found["class_auc"] if not np.isnan(a)]
    assert len(judged) >= 5  # classes some silos hold and some lack
    assert judged == [0.5] * len(judged)
    assert found["within_class_auc"] == 0.5
    # pooled over classes the guess is the class prior, which the counts do reveal, and no better
    assert 0.5 < found["all"]["auc"] < 0.9


def toy_model() -> SplitModel:
    """Features are the inputs (ReLU of a 3-vector), the head the identity: class c lives on axis c."""
    model = SplitModel(nn.ReLU(), 3, 3)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.eye(3))
        model.classifier.bias.zero_()
    return model


PUBLIC_X = torch.tensor([[1.0, 0.1, 0.0], [0.9, 0.0, 0.1], [0.0, 1.0, 0.1], [0.1, 0.9, 0.0], [0.0, 0.1, 1.0]])
PUBLIC_Y = torch.tensor([0, 0, 1, 1, 2])


def test_scores_have_one_row_per_silo_in_sorted_order_and_rank_real_means_above_masks():
    """Guards the layout (silos sorted) and each model-based detector's direction on a hand-made case."""
    real = torch.tensor([[0.95, 0.05, 0.05], [0.05, 0.95, 0.05], [0.0, 0.1, 1.0]], dtype=torch.float64)
    masked = real.clone()
    masked[2] = torch.tensor([0.5, 0.5, 0.3])  # silo "b" lacks class 2: a mask inside its means' box
    scores = presence_scores({"b": masked, "a": real}, toy_model(), PUBLIC_X, PUBLIC_Y, min_samples=2)
    assert list(scores) == list(DETECTORS)
    for name, s in scores.items():
        assert s.shape == (2, 3), name
        assert (s[0, :2] == s[1, :2]).all(), name  # same rows, same scores
    for name in ("margin", "cosine", "norm"):
        assert scores[name][0, 2] > scores[name][1, 2], name  # row 0 is "a", whose class-2 mean is real
    assert scores["norm"].max() == 0.0  # a real mean's norm lies in the range a real mean can have


def test_report_splits_head_from_tail_classes():
    """Guards the stratification: tail classes are those with fewer than `tail_below` training samples."""
    truth = np.array([[1, 1, 1], [1, 0, 0], [0, 1, 1], [0, 0, 0]], dtype=bool)
    scores = np.where(truth, 1.0, 0.0)
    scores[:, 2] = 1.0 - scores[:, 2]  # perfect on the two head classes, inverted on the tail class
    found = presence_report({"toy": scores}, truth, class_frequency=np.array([100, 50, 5]), tail_below=10)[
        "toy"
    ]
    assert found["head"]["auc"] == 1.0
    assert found["head"]["positives"] == 4
    assert found["tail"]["auc"] == 0.0
    assert found["tail"]["positives"] == 2
    assert found["class_auc"] == [1.0, 1.0, 0.0]
    assert found["within_class_auc"] == pytest.approx(2 / 3)
    assert 0.0 < found["all"]["auc"] < 1.0


GOOD = torch.zeros(3, 3, dtype=torch.float64)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: presence_scores({}, toy_model(), PUBLIC_X, PUBLIC_Y), "no disclosures"),
        (
            lambda: presence_scores({"a": GOOD, "b": torch.zeros(3, 4)}, toy_model(), PUBLIC_X, PUBLIC_Y),
            r"\[classes, features\]",
        ),
        (lambda: presence_scores({"a": GOOD}, nn.Linear(3, 3), PUBLIC_X, PUBLIC_Y), "SplitModel"),
        (
            lambda: presence_scores({"a": torch.zeros(4, 3)}, toy_model(), PUBLIC_X, PUBLIC_Y),
            "4 classes, the model's head 3",
        ),
        (lambda: presence_scores({"a": GOOD}, toy_model(), PUBLIC_X, PUBLIC_Y[:4]), "5 public images"),
        (lambda: presence_scores({"a": GOOD}, toy_model(), PUBLIC_X[:4], PUBLIC_Y[:4]), r"classes \[2\]"),
        (
            lambda: presence_scores({"a": torch.zeros(3, 2)}, toy_model(), PUBLIC_X, PUBLIC_Y),
            "2 features, the model's encoder 3",
        ),
        (lambda: census_scores(np.array([1, 4]), 3), r"in \[0, 3\]"),
        (lambda: census_scores(np.array([0.5, 1]), 3), "whole numbers"),
        (lambda: census_scores(np.ones((2, 2)), 3), "one per class"),
        (lambda: census_scores(np.array([1]), 0), "at least one silo"),
        (
            lambda: presence_report(
                {"x": np.zeros((2, 3))}, np.zeros((2, 3)), class_frequency=np.ones(3), tail_below=1
            ),
            "boolean",
        ),
        (
            lambda: presence_report(
                {"x": np.zeros((2, 3))}, np.zeros((2, 3), bool), class_frequency=np.ones(2), tail_below=1
            ),
            "class_frequency",
        ),
        (
            lambda: presence_report(
                {"x": np.zeros((3, 2))}, np.zeros((2, 3), bool), class_frequency=np.ones(3), tail_below=1
            ),
            "match truth's shape",
        ),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(call, message):
    """Guards the checks: malformed disclosures, models, public data, counts and labels raise ValueError."""
    with pytest.raises(ValueError, match=message):
        call()
