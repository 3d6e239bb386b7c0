"""The balanced recipe: a priors round of summed counts, prior-adjusted local training, a calibrated head."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedlt.data.arrays import LabeledData
from fedlt.errors import ContributionError
from fedlt.methods import SiloContext, TrainConfig, balanced
from fedlt.methods.balanced import CLASS_COUNTS, PRIORS, Balanced, BalancedOptions
from fedlt.methods.fedavg import WEIGHT_SCALE
from fedlt.methods.posthoc import CLOSING
from fedlt.methods.state import GlobalState
from tests.method_harness import SPEC, plaintext_step, tiny_silos

TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _balanced(rounds=2, **options):
    defaults = {"virtual_per_class": 50, "calibrate_epochs": 2}
    return Balanced(
        options=BalancedOptions(**{**defaults, **options}), train=TRAIN, model=SPEC, rounds=rounds
    )


def test_a_priors_round_then_training_then_a_closing_calibration():
    method, silos = _balanced(rounds=2, calibrate="post-hoc"), tiny_silos()
    state = method.init_state(seed=0)
    assert method.remaining_rounds(state) == 4
    schema = method.schema(state)
    assert schema.phase == PRIORS
    assert [f.name for f in schema.fields] == ["count"]
    assert not method.trains(state)  # every silo counts, also under partial participation
    state = plaintext_step(method, state, silos, 1)
    assert state.extra[CLASS_COUNTS].tolist() == [8.0, 7.0, 6.0, 0.0]  # summed over the three silos
    assert int(state.extra[WEIGHT_SCALE]) == 2 * 21  # round 1 at the later rounds' precision
    assert state.model is not None
    assert method.remaining_rounds(state) == 3
    for r in (2, 3):
        assert method.trains(state)
        assert {f.name for f in method.schema(state).fields} == {"delta", "n"}
        state = plaintext_step(method, state, silos, r)
    assert method.schema(state).phase == CLOSING
    state = plaintext_step(method, state, silos, 4)
    assert "head.weight" in state.extra
    assert method.remaining_rounds(state) == 0


def test_by_default_the_trained_head_is_evaluated_after_the_priors_and_training_rounds():
    method, silos = _balanced(rounds=2), tiny_silos()
    state = method.init_state(seed=0)
    assert method.remaining_rounds(state) == 3
    assert method.statistics_plan() == ((), 0)  # nothing but counts and the model change is released
    for r in (1, 2, 3):
        state = plaintext_step(method, state, silos, r)
        assert {f.name for f in method.schema(state).fields} <= {"delta", "n"}
    assert method.remaining_rounds(state) == 0
    assert set(state.extra) == {"trained", WEIGHT_SCALE, CLASS_COUNTS}


def test_the_adjusted_loss_leaves_the_balanced_posterior_on_inputs_that_say_nothing():
    """With noise for inputs the best f(x) under plain cross-entropy is log π (the training prior); under
    Balanced Softmax f(x) + log π is, so f(x) is flat: a tail class is predicted as often as a head class."""
    rng = np.random.default_rng(1)
    y = np.repeat([0, 1, 2, 3], [160, 40, 16, 4])
    data = LabeledData(rng.random((len(y), 1, 8, 8), dtype=np.float32), y, tuple("abcd"))
    counts = torch.tensor(np.bincount(y, minlength=4), dtype=torch.float64)
    train = TrainConfig(local_epochs=15, batch_size=16, lr=0.05, momentum=0.9)

    def mean_probabilities(tau):
        method = Balanced(options=BalancedOptions(tau=tau), train=train, model=SPEC, rounds=1)
        state = method.init_state(seed=0)
        state = GlobalState(1, state.model, {**state.extra, CLASS_COUNTS: counts})
        model = method.load(state.model)
        method.train_model(
            model, torch.from_numpy(data.x), torch.from_numpy(y), state, SiloContext(1, "s", 0)
        )
        model.eval()
        with torch.no_grad():
            return torch.softmax(model(torch.rand(500, 1, 8, 8)), dim=1).mean(0)

    plain, adjusted = mean_probabilities(0.0), mean_probabilities(1.0)
    assert plain[0] > 0.55
    assert plain[3] < 0.05
    assert (adjusted - 0.25).abs().max() < 0.1


def test_a_class_the_tail_guard_held_back_gets_the_smallest_revealed_prior_times_beta():
    method = _balanced(beta_pi=0.5)
    counts = torch.tensor([100.0, 10.0, 0.0, 4.0], dtype=torch.float64)
    state = GlobalState(
        1, method.init_state(seed=0).model, {"trained": torch.tensor(0), CLASS_COUNTS: counts}
    )
    prior = method.adjusting_prior(state, torch.zeros(1).long(), SiloContext(2, "s", 0))
    assert prior.tolist() == [100.0, 10.0, 2.0, 4.0]


@pytest.mark.parametrize(
    "counts",
    [
        torch.tensor([1.0, 2.0, 3.0]),  # the wrong number of classes
        torch.tensor([1.0, -2.0, 3.0, 4.0]),
        torch.tensor([1.0, float("nan"), 3.0, 4.0]),
        torch.tensor([1.0, float("inf"), 3.0, 4.0]),
        torch.zeros(4),
        torch.tensor([1, 2, 3, 4]),  # integers: not what any server step makes
    ],
)
def test_a_silo_refuses_class_counts_no_priors_round_could_have_summed(counts):
    method, silos = _balanced(), tiny_silos()
    state = method.init_state(seed=0)
    state = GlobalState(1, state.model, {**state.extra, CLASS_COUNTS: counts})
    with pytest.raises(ContributionError, match="class counts"):
        method.local_round(state, silos[0], SiloContext(2, "silo-0", 0))


def test_the_priors_round_refuses_sums_without_any_count():
    method = _balanced()
    state = method.init_state(seed=0)
    empty = [replace(tiny_silos()[0], y=np.zeros(0, dtype=np.int64), x=np.zeros((0, 1, 8, 8), np.float32))]
    with pytest.raises(ContributionError, match="no class has a count"):
        plaintext_step(method, state, empty, 1)


def test_local_priors_adjust_by_the_silos_own_counts():
    method, silos = _balanced(prior="local"), tiny_silos()
    state = method.init_state(seed=0)
    state = plaintext_step(method, state, silos, 1)
    bogus = GlobalState(state.round, state.model, {**state.extra, CLASS_COUNTS: torch.zeros(4)})
    plaintext_step(method, bogus, silos, 2)  # the global counts are not read


@pytest.mark.parametrize(("shift", "pixels"), [(0.0, 0), (0.07, 1), (0.25, 2)])
def test_local_training_sees_images_moved_by_the_shift_as_a_fraction_of_their_side(
    monkeypatch, shift, pixels
):
    limits: list[int] = []
    real_shift = balanced.random_shift

    def spy(x, limit, generator):
        limits.append(limit)
        return real_shift(x, limit, generator)

    monkeypatch.setattr(balanced, "random_shift", spy)
    method, silos = _balanced(shift=shift), tiny_silos()
    state = plaintext_step(method, method.init_state(seed=0), silos, 1)
    plaintext_step(method, state, silos, 2)
    assert limits  # one call a batch, on the harness's 8×8 images
    assert set(limits) == {pixels}
