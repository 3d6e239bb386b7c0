"""The one-run ε audit (attacks.epsilon): the bound's known answers, and that the canaries catch a DP-SGD
that adds less noise than its ledger books while a correct one stays under its charged ε."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attacks.epsilon import (
    CanaryRound,
    EpsilonAudit,
    NoiseOff,
    WithCanaries,
    audit_private,
    epsilon_audit,
    epsilon_grid,
    silo_round,
)
from attacks.one_run import best_guesses, lower_bound, p_value
from fedlt.dp import DPSettings
from fedlt.methods import TrainConfig
from fedlt.methods.dpsgd import train_private
from fedlt.methods.local import PrivateRound, cross_entropy
from tests.test_dp_sgd import _tiny

DELTA = 1e-5
CANARIES = 20_000
TRAIN = TrainConfig(local_epochs=3, batch_size=20, lr=0.1)  # 200 records: q = 0.1, 30 steps


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(rng.integers(0, 10, n).astype(np.int64))


# ---------------------------------------------------------------- the bound


@pytest.mark.parametrize("guesses", [1, 10, 100, 1000])
def test_perfect_guesses_at_delta_zero_give_randomised_responses_epsilon(guesses):
    """r right of r at δ = 0 rejects exactly the ε whose randomised response is right r times with
    probability β: e^ε / (1 + e^ε) = β^(1/r) (and nothing, ε ≥ 0, when that is under 1/2)."""
    accuracy = 0.05 ** (1 / guesses)
    bound = lower_bound(guesses=guesses, correct=guesses, canaries=guesses, delta=0.0, beta=0.05)
    assert bound == pytest.approx(max(0.0, math.log(accuracy / (1 - accuracy))), rel=1e-9)


def test_one_right_guess_pays_the_delta_term():
    """r = v = 1: p = q + 2mδ(1 − q), so with m = 1, δ = 0.1 and β = 0.9 the bound is logit(0.875) = ln 7."""
    assert lower_bound(guesses=1, correct=1, canaries=1, delta=0.1, beta=0.9) == pytest.approx(math.log(7))
    assert p_value(guesses=1, correct=1, canaries=1, epsilon=math.log(7), delta=0.1) == pytest.approx(0.9)


def test_chance_level_guessing_proves_nothing():
    assert lower_bound(guesses=1000, correct=500, canaries=1000, delta=DELTA, beta=0.05) == 0.0
    assert p_value(guesses=10, correct=0, canaries=10, epsilon=1.0, delta=DELTA) == 1.0


def test_counts_out_of_order_are_refused():
    with pytest.raises(ValueError, match="correct <= guesses <= canaries"):
        p_value(guesses=10, correct=11, canaries=100, epsilon=1.0, delta=DELTA)
    with pytest.raises(ValueError, match="β is in"):
        lower_bound(guesses=10, correct=10, canaries=10, delta=DELTA, beta=1.0)


counts = st.integers(1, 3000).flatmap(
    lambda r: st.tuples(st.just(r), st.integers(0, r), st.integers(r, 10 * r))
)


@settings(max_examples=40, deadline=None)
@given(counts, st.sampled_from([0.0, 1e-6, 1e-5, 1e-3]))
def test_the_bound_is_rejected_at_its_level_and_grows_with_right_guesses(rvm, delta):
    """Sound: the p-value at the bound is under β. Monotone: one more right guess never lowers it, a larger δ
    or a smaller β never raises it."""
    guesses, correct, canaries = rvm
    bound = lower_bound(guesses=guesses, correct=correct, canaries=canaries, delta=delta, beta=0.05)
    if bound > 0:
        p = p_value(guesses=guesses, correct=correct, canaries=canaries, epsilon=bound, delta=delta)
        assert p < 0.05
    if correct < guesses:
        more = lower_bound(guesses=guesses, correct=correct + 1, canaries=canaries, delta=delta, beta=0.05)
        assert more >= bound
    assert (
        lower_bound(guesses=guesses, correct=correct, canaries=canaries, delta=2 * delta + 1e-7, beta=0.05)
        <= bound
    )
    assert lower_bound(guesses=guesses, correct=correct, canaries=canaries, delta=delta, beta=0.01) <= bound


def test_perfect_scores_reach_the_ceiling_and_random_ones_prove_nothing():
    rng = np.random.default_rng(0)
    inserted = rng.random(CANARIES) < 0.5
    perfect = best_guesses(inserted.astype(float), inserted, delta=DELTA, confidence=0.95)
    assert perfect.correct == perfect.guesses
    assert perfect.lower_bound == perfect.ceiling > 4
    noise = best_guesses(rng.standard_normal(CANARIES), inserted, delta=DELTA, confidence=0.95)
    assert noise.lower_bound == 0.0


# ---------------------------------------------------------------- the canaries in DP-SGD


class CountingBernoulli:
    """The silo's privacy side, noting every Poisson draw it is asked for."""

    def __init__(self, private: PrivateRound) -> None:
        self._private = private
        self.draws: list[tuple[int, float]] = []

    def __getattr__(self, name: str):
        return getattr(self._private, name)

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        self.draws.append((count, p))
        return self._private.bernoulli(count, p)


def test_canaries_are_drawn_by_the_silos_sampler_and_move_by_one_clipped_record_each():
    """Noise off, one step: the silo's sampler draws records and canaries together at the accountant's rate,
    and each canary in and sampled descends by lr·C / (expected batch size), every other one stays at 0."""
    x, y = _data()
    settings = DPSettings(enabled=True, epsilon=4.0, delta=DELTA, max_grad_norm=2.0)
    counting = CountingBernoulli(NoiseOff(silo_round(settings, seed=0)))
    inserted = np.random.default_rng(1).random(1000) < 0.5
    model = WithCanaries(_tiny(), 1000)
    round_ = CanaryRound(counting, model.canaries, inserted)
    config = TrainConfig(local_epochs=1, batch_size=200, lr=0.1)  # rate 1: one step, every canary sampled
    train_private(model, x, y, config, round_, loss=cross_entropy, after_clipping=round_.add_canaries)
    assert counting.draws == [(200 + 1000, 1.0)]
    expected = -0.1 * 2.0 / 200 * torch.from_numpy(inserted).float()
    torch.testing.assert_close(model.canaries.detach().flatten(), expected)


def test_a_canary_step_without_its_batch_is_refused():
    model = WithCanaries(_tiny(), 10)
    round_ = CanaryRound(silo_round(DPSettings(enabled=True), seed=0), model.canaries, np.ones(10, bool))
    with pytest.raises(RuntimeError, match="before its batch was sampled"):
        round_.add_canaries()


def test_an_audit_needs_canaries():
    x, y = _data()
    with pytest.raises(ValueError, match="at least one canary"):
        epsilon_audit(_tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=0, seed=0, train=TRAIN)


def test_with_the_noise_off_the_bound_reaches_its_ceiling():
    x, y = _data()
    audit = epsilon_audit(
        _tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=CANARIES, seed=0, train=TRAIN, control=True
    )
    assert audit.control
    assert audit.correct == audit.guesses
    assert audit.lower_bound == audit.ceiling > 5
    assert audit.at_ceiling
    assert audit.violated  # the ε = 1 its ledger books is false of a run without noise, and the audit says so


def test_the_grid_audits_each_epsilon_then_the_control_at_the_largest():
    x, y = _data()
    runs = epsilon_grid(_tiny(), x, y, epsilons=[1.0, 4.0], delta=DELTA, canaries=2000, seed=0, train=TRAIN)
    assert [(a.target, a.control) for a in runs] == [(1.0, False), (4.0, False), (4.0, True)]
    assert [a.charged for a in runs[:2]] == sorted(a.charged for a in runs[:2])
    assert not any(a.violated for a in runs[:2])


def test_a_correct_dp_sgd_stays_under_its_charged_epsilon():
    x, y = _data()
    audit = epsilon_audit(_tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=CANARIES, seed=0, train=TRAIN)
    assert audit.target == 1.0
    assert 0 < audit.charged <= 1.0
    assert audit.lower_bound <= audit.charged
    assert not audit.violated


class QuieterNoise:
    """A broken DP-SGD: the silo's privacy side with its noise cut tenfold behind the accountant's back."""

    def __init__(self, private: PrivateRound, factor: float) -> None:
        self._private = private
        self._factor = factor

    def __getattr__(self, name: str):
        return getattr(self._private, name)

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        draw = self._private.noise_stream()
        return lambda count, std: draw(count, std * self._factor)


def test_noise_cut_tenfold_behind_the_ledgers_back_is_caught():
    """The attack: the ledger charges ε ≤ 1 for σ it picked while the noise added is σ/10; nothing else in
    the silo notices. The canaries prove an ε above what was charged."""
    x, y = _data()
    private = QuieterNoise(silo_round(DPSettings(enabled=True, epsilon=1.0, delta=DELTA), seed=0), 0.1)
    audit = audit_private(
        _tiny(), x, y, private, delta=DELTA, canaries=CANARIES, seed=0, train=TRAIN, target=1.0
    )
    assert audit.charged <= 1.0
    assert audit.violated, audit.describe()


def test_the_description_names_the_bound_and_what_was_charged():
    audit = EpsilonAudit(
        target=8.0,
        delta=DELTA,
        charged=7.98,
        noise_multiplier=0.73,
        sample_rate=0.066,
        steps=48,
        canaries=100_000,
        inserted=50_000,
        guesses=3000,
        correct=2537,
        lower_bound=1.43,
        ceiling=5.82,
        confidence=0.95,
        control=False,
        seconds=8.0,
    )
    assert "ε ≥ 1.43 at 95% (ceiling 5.82) against 7.98 charged" in audit.describe()
    assert not audit.violated
