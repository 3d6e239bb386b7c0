"""A hostile review of issue 36's audit: the one-run ε bound against the theorem term by term, broken DP-SGDs
the canaries should catch, a control that fails a correct run, a summary that hides a leak, and census reads
that miss or invent a leak. Each was a failing test when the review found it (the attack, before the fix)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binom

import attacks.epsilon as epsilon_module
import fedlt.methods.dpsgd as dpsgd
from attacks.aggregator_data import _census_finding
from attacks.audit import Finding
from attacks.config import AuditConfig, Mode, load_audit_config
from attacks.epsilon import CanaryRound, WithCanaries, epsilon_audit, silo_round
from attacks.one_run import p_value
from attacks.summary import render_summary
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.methods import TrainConfig
from fedlt.methods.local import cross_entropy
from tests.test_attacks_epsilon import CANARIES, DELTA, TRAIN, _data
from tests.test_dp_sgd import _tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- the theorem, term by term


def theorem(guesses: int, correct: int, canaries: int, epsilon: float, delta: float) -> float:
    """Steinke, Nasr, Jagielski (2023), (ε, δ) main theorem, written out: f(v) + 2mδ·max_i (f(v−i) − f(v))/i
    over i = 1..m, f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v]."""
    q = np.exp(epsilon) / (1 + np.exp(epsilon))

    def f(v: int) -> float:
        return 1.0 if v <= 0 else float(binom.sf(v - 1, guesses, q))

    alpha = max((f(correct - i) - f(correct)) / i for i in range(1, canaries + 1))
    return min(1.0, f(correct) + 2 * canaries * delta * alpha)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 60).flatmap(lambda r: st.tuples(st.just(r), st.integers(1, r), st.integers(r, 4 * r))),
    st.floats(0.0, 8.0),
    st.sampled_from([1e-5, 1e-3, 1e-2]),
)
def test_the_p_value_is_the_theorem_never_below_it(rvm, epsilon, delta):
    """A p-value under the theorem's makes the bound too high (a false failure); far above it, too low."""
    guesses, correct, canaries = rvm
    exact = theorem(guesses, correct, canaries, epsilon, delta)
    found = p_value(guesses=guesses, correct=correct, canaries=canaries, epsilon=epsilon, delta=delta)
    assert found >= exact * (1 - 1e-9)
    assert found == pytest.approx(exact, rel=1e-6, abs=1e-300)


# ---------------------------------------------------------------- broken DP-SGDs the canaries should catch


def _noise_only_where_no_record_reaches(params, noise, expected_batch_size):
    """The bug: the clipped sums of the records go out without noise; only gradient-less parameters get it."""
    start = 0
    for p in params:
        share = noise[start : start + p.numel()].view_as(p)
        p.grad = (share if p.grad is None else p.grad).div_(expected_batch_size)
        start += p.numel()


def test_a_dp_sgd_that_leaves_the_records_sums_unnoised_is_caught(monkeypatch):
    """Attack mounted: every record's clipped gradient is released without noise, the ledger books ε ≤ 1."""
    monkeypatch.setattr(dpsgd, "privatise", _noise_only_where_no_record_reaches)
    x, y = _data()
    audit = epsilon_audit(_tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=CANARIES, seed=0, train=TRAIN)
    assert audit.violated, audit.describe()


class EveryRecordEveryStep:
    """Wraps what train_private is given: its sampler asked for rate 1 while the ledger was told q."""

    def __init__(self, private) -> None:
        self._private = private

    def __getattr__(self, name: str):
        return getattr(self._private, name)

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        return self._private.bernoulli(count, 1.0)


def test_a_dp_sgd_that_samples_more_than_it_books_is_caught(monkeypatch):
    """Attack mounted: full-batch steps (every record, every step) while the accountant is told q = 0.1."""
    real = epsilon_module.train_private

    def oversampling(model, x, y, config, private, **kwargs):
        return real(model, x, y, config, EveryRecordEveryStep(private), **kwargs)

    monkeypatch.setattr(epsilon_module, "train_private", oversampling)
    x, y = _data()
    audit = epsilon_audit(_tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=CANARIES, seed=0, train=TRAIN)
    assert audit.violated, audit.describe()


# ---------------------------------------------------------------- the control on a correct configuration


def test_the_no_noise_control_reaches_its_ceiling_at_one_epoch():
    x, y = _data()
    one_epoch = TrainConfig(local_epochs=1, batch_size=TRAIN.batch_size, lr=TRAIN.lr)
    audit = epsilon_audit(
        _tiny(), x, y, epsilon=1.0, delta=DELTA, canaries=CANARIES, seed=0, train=one_epoch, control=True
    )
    assert audit.at_ceiling, audit.describe()


# ---------------------------------------------------------------- the summary a privacy officer signs

GUARD = Mode(name="secagg + tail guard", privacy="secagg", k_min=2)


def test_a_mode_that_leaks_only_by_feature_error_reads_as_a_leak_in_the_summary():
    metrics = {"ssim": 0.25, "ssim_random": 0.01, "ssim_prior": 0.2, "psnr": 10.0, "mae": 0.1}
    feature = Finding(
        "analytic",
        GUARD.name,
        "aggregator, the sum",
        "class 9: one record",
        {**metrics, "feature_error": 0.01},
        True,
        True,
    )
    decoded = Finding(
        "decoder: SFD SAFS features",
        GUARD.name,
        "aggregator, the sum",
        "class 9: one record",
        {**metrics, "ssim": 0.3},
        False,
        True,
    )
    lines = render_summary(AuditConfig(modes=(GUARD,)), [feature, decoded])
    (row,) = [line for line in lines if line.startswith(f"| {GUARD.name}")]
    assert "**LEAK**" in row, row


# ---------------------------------------------------------------- the census check of a store


def test_two_censuses_over_different_silos_are_caught():
    """The check's own case, as a baseline: silo c left out of the second census gives its bit away."""
    finding = _census_finding({"train": (("a", "b", "c"), [1]), "close": (("a", "b"), [0])}, "store")
    assert finding.leaked


def test_a_later_census_that_contradicts_does_not_hide_two_that_pin_a_bit():
    finding = _census_finding(
        {
            "study-1 train": (("a", "b", "c"), [1]),
            "study-1 close": (("a", "b"), [0]),  # with the first: c holds the class
            "study-2 train": (("a", "b", "c"), [2]),  # b has since gained records of it
        },
        "store",
    )
    assert finding.leaked
    assert finding.metrics["bits_beyond_census"] >= 0


def test_censuses_over_disjoint_sets_of_many_silos_are_no_leak():
    silos = [f"silo-{i:02d}" for i in range(22)]
    enumerable = _census_finding({"a": (tuple(silos[:10]), [3]), "b": (tuple(silos[10:20]), [5])}, "store")
    assert not enumerable.leaked
    many = _census_finding({"a": (tuple(silos[:11]), [3]), "b": (tuple(silos[11:]), [5])}, "store")
    assert not many.leaked, many.note


def test_the_canary_block_receives_noise_through_the_silos_stream():
    """What the audit does exercise: with the real privatise the canary coordinates of left-out canaries move
    by noise alone, so a run's scores are not all zero where nothing was inserted."""
    x, y = _data()
    model = WithCanaries(_tiny(), 100)
    private = silo_round(DPSettings(enabled=True, epsilon=1.0, delta=DELTA), seed=0)
    round_ = CanaryRound(private, model.canaries, np.zeros(100, dtype=bool))
    dpsgd.train_private(model, x, y, TRAIN, round_, loss=cross_entropy, after_clipping=round_.add_canaries)
    assert torch.count_nonzero(model.canaries.detach()) == 100


def test_too_few_canaries_to_prove_any_epsilon_of_the_grid_is_a_config_error(tmp_path):
    grid = (
        (Path(__file__).parent.parent / "configs" / "audit.toml")
        .read_text()
        .replace("canaries = 100000", "canaries = 10")
    )
    (tmp_path / "audit.toml").write_text(grid)
    with pytest.raises(ConfigError, match=r"epsilon\.canaries"):
        load_audit_config(tmp_path / "audit.toml")
