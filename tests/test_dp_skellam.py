import dataclasses
import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp
from scipy.stats import chi2_contingency, skellam

from privacy.dp.accountant import ORDERS, epsilon, gaussian_rdp, orders
from privacy.dp.noise import SecureRandom
from privacy.dp.skellam import (
    SkellamShare,
    l2_to_l1,
    rounded_l2,
    skellam_rdp,
    skellam_variance_for,
)

ALPHA = orders()


def _at(rdp: np.ndarray, alpha: float) -> float:
    (index,) = np.flatnonzero(alpha == ALPHA)
    return float(rdp[index])


def _gaussian_epsilon(noise_multiplier: float, delta: float, count: int = 1) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), count)
    return accountant.get_epsilon(delta)


# ---------------------------------------------------------------- the bound, by hand and against exact values


def test_rdp_known_values_by_hand():
    # ε(α) = α·Δ2²/(2V) + min(((2α−1)·Δ2² + 6·Δ1)/(4V²), 3·Δ1/(2V))
    # Δ1 = Δ2 = 1, V = 1, α = 2: 2/2 + min((3 + 6)/4, 3/2) = 1 + min(2.25, 1.5) = 2.5
    assert _at(skellam_rdp(l1=1, l2=1, variance=1), 2.0) == pytest.approx(2.5)
    # ten ±1 coordinates: Δ1 = 10, Δ2² = 10, V = 100, α = 10:
    # 10·10/200 + min((19·10 + 60)/(4·10⁴), 30/200) = 0.5 + min(0.00625, 0.15) = 0.50625
    assert _at(skellam_rdp(l1=10, l2=math.sqrt(10), variance=100), 10.0) == pytest.approx(0.50625)
    # Δ1 = 4, Δ2 = 2, V = 2, α = 3: 3·4/4 + min((5·4 + 24)/16, 12/4) = 3 + min(2.75, 3) = 5.75
    assert _at(skellam_rdp(l1=4, l2=2, variance=2), 3.0) == pytest.approx(5.75)
    # Δ1 = 1000, Δ2 = 10, V = 4, α = 2: 2·100/8 + min((3·100 + 6000)/64, 3000/8) = 25 + min(98.4375, 375)
    assert _at(skellam_rdp(l1=1000, l2=10, variance=4), 2.0) == pytest.approx(123.4375)
    # Δ1 = 1000, Δ2 = 10, V = 1, α = 2: 100 + min((300 + 6000)/4, 1500) = 100 + min(1575, 1500) = 1600
    assert _at(skellam_rdp(l1=1000, l2=10, variance=1), 2.0) == pytest.approx(1600)


def test_fractional_orders_take_the_bound_at_the_next_integer():
    rdp = skellam_rdp(l1=4, l2=2, variance=2)
    assert _at(rdp, 2.5) == _at(rdp, 3.0) == pytest.approx(5.75)
    assert _at(rdp, 1.1) == _at(rdp, 2.0)
    assert np.all(np.diff(rdp) >= 0)


def test_epsilon_known_value():
    # One order by hand (Balle et al. 2020, Thm 21: ε ≤ rdp + ln((α−1)/α) − (ln δ + ln α)/(α−1)), δ = 1e-5,
    # at α = 10 with the 0.50625 above: 0.50625 + ln 0.9 + (11.512925 − 2.302585)/9
    #   = 0.50625 − 0.105361 + 1.023371 = 1.424261; the accountant takes the best order, so ε is at most that.
    rdp = skellam_rdp(l1=10, l2=math.sqrt(10), variance=100)
    eps = epsilon(rdp, 1e-5)
    assert eps <= 1.424261
    best = np.min(rdp + np.log((ALPHA - 1) / ALPHA) - (math.log(1e-5) + np.log(ALPHA)) / (ALPHA - 1))
    assert eps == pytest.approx(best, rel=1e-9)


def _exact_divergence(alpha: int, shift: int, variance: float) -> float:
    """D_α(shift + Sk || Sk) for Sk = Skellam(V/2, V/2), summed over (nearly) all of its support."""
    half = variance / 2
    reach = int(80 * math.sqrt(variance) + 100 + shift)
    k = np.arange(-reach, reach + 1)
    lp, lq = skellam.logpmf(k - shift, half, half), skellam.logpmf(k, half, half)
    keep = np.isfinite(lp) & np.isfinite(lq)
    return float(logsumexp(alpha * lp[keep] + (1 - alpha) * lq[keep]) / (alpha - 1))


@pytest.mark.parametrize("variance", [0.5, 2.0, 10.0, 200.0, 5000.0])
@pytest.mark.parametrize("shift", [1, 3, 8])
@pytest.mark.parametrize("alpha", [2, 5, 20])
def test_bound_holds_over_the_exact_divergence_with_mu_the_variance(variance, shift, alpha):
    # One coordinate: Δ1 = Δ2 = |shift|. Reading the paper's μ as the variance (Google's reading) is valid,
    # and tight once the variance is large; the divergence tends to the Gaussian's α·Δ²/(2V).
    exact = _exact_divergence(alpha, shift, variance)
    bound = _at(skellam_rdp(l1=shift, l2=shift, variance=variance), float(alpha))
    assert exact <= bound * (1 + 1e-9)
    if variance >= 5000:
        assert exact >= 0.99 * bound
        assert exact == pytest.approx(alpha * shift**2 / (2 * variance), rel=0.01)


def test_tends_to_the_gaussian_of_dp_accounting():
    # l1 = √d·l2 fixed ratio, noise multiplier 1 (V = l2²): the discrete term vanishes as the grid refines.
    dims, delta = 1000, 1e-5
    gaussian = _gaussian_epsilon(1.0, delta)
    integer = np.round(ALPHA) == ALPHA
    rdp_gaps, eps_gaps = [], []
    for l2 in (4.0, 16.0, 64.0, 256.0, 1024.0):
        variance = l2**2
        rdp = skellam_rdp(l1=math.sqrt(dims) * l2, l2=l2, variance=variance)
        rdp_gaps.append(np.max(rdp[integer] / (ALPHA[integer] * l2**2 / (2 * variance)) - 1))
        eps_gaps.append(epsilon(rdp, delta) / gaussian - 1)
    for gaps in (rdp_gaps, eps_gaps):
        assert all(g >= 0 for g in gaps)
        assert all(a > b for a, b in itertools.pairwise(gaps))
    assert rdp_gaps[-1] < 1e-3  # α·l2²/(2V) at integer orders
    assert eps_gaps[-1] < 0.02  # what is left is the ⌈α⌉ of fractional orders


@given(
    l2=st.floats(0.1, 1e4),
    noise_multiplier=st.floats(0.3, 50.0),
    ratio=st.floats(1.0, 1000.0),
    delta=st.sampled_from([1e-5, 1e-7]),
)
@settings(max_examples=60, deadline=None, derandomize=True)
def test_never_below_the_gaussian_of_the_same_variance(l2, noise_multiplier, ratio, delta):
    variance = (noise_multiplier * l2) ** 2
    rdp = skellam_rdp(l1=ratio * l2, l2=l2, variance=variance)
    assert np.all(rdp >= ALPHA * l2**2 / (2 * variance))
    eps = epsilon(rdp, delta)
    assert eps >= epsilon(gaussian_rdp(noise_multiplier=noise_multiplier), delta)
    assert eps >= _gaussian_epsilon(noise_multiplier, delta) * (1 - 1e-9)


def test_zero_sensitivity_and_zero_variance():
    assert np.all(skellam_rdp(l1=0, l2=0, variance=0) == 0)
    assert np.all(np.isinf(skellam_rdp(l1=1, l2=1, variance=0)))


# ---------------------------------------------------------------- calibration


@given(
    l2=st.floats(1.0, 1000.0),
    dims=st.integers(1, 10_000),
    target=st.floats(0.3, 10.0),
    delta=st.sampled_from([1e-5, 1e-6]),
    releases=st.integers(1, 50),
    spent_sigma=st.one_of(st.none(), st.floats(2.0, 50.0)),
)
@settings(max_examples=40, deadline=None, derandomize=True)
def test_variance_for_fits_and_is_within_one_percent_of_minimal(
    l2, dims, target, delta, releases, spent_sigma
):
    spent = None if spent_sigma is None else gaussian_rdp(noise_multiplier=spent_sigma)
    if spent is not None:
        assume(epsilon(spent, delta) < 0.8 * target)
    l1 = l2_to_l1(l2, dims)
    variance = skellam_variance_for(
        l1=l1, l2=l2, target_epsilon=target, delta=delta, releases=releases, spent=spent
    )
    base = np.zeros(len(ORDERS)) if spent is None else spent

    def eps(v: float) -> float:
        return epsilon(base + releases * skellam_rdp(l1=l1, l2=l2, variance=v), delta)

    assert eps(variance) <= target
    assert eps(0.99 * variance) > target


def test_variance_for_zero_sensitivity_is_zero():
    assert skellam_variance_for(l1=0, l2=0, target_epsilon=1.0, delta=1e-5) == 0.0


# ---------------------------------------------------------------- shares, survivors and sampling


@pytest.mark.parametrize(("participants", "threshold"), [(1, 1), (3, 2), (5, 3), (8, 8), (10, 4)])
def test_summed_noise_of_every_survivor_count_has_the_right_variance(participants, threshold):
    share = SkellamShare(variance_total=40.0, threshold=threshold, participants=participants)
    assert threshold * 2 * share.per_silo_mean == pytest.approx(40.0)
    count = 20_000
    seeds = [f"silo-{participants}-{threshold}-{i}" for i in range(participants)]
    silos = np.stack([share.sample(count, SecureRandom.seeded(seed)) for seed in seeds])
    for survivors in range(threshold, participants + 1):
        total = silos[:survivors].sum(axis=0)
        expected = survivors * 2 * share.per_silo_mean
        assert share.variance_with(survivors) == pytest.approx(expected)
        assert np.var(total) == pytest.approx(expected, rel=0.10)
        assert abs(np.mean(total)) < 5 * math.sqrt(expected / count)
        if survivors == threshold:
            assert np.var(total) == pytest.approx(share.variance_total, rel=0.10)


def test_share_rdp_uses_the_survivors_variance():
    share = SkellamShare(variance_total=50.0, threshold=2, participants=5)
    assert np.array_equal(share.rdp(l1=10, l2=3), skellam_rdp(l1=10, l2=3, variance=50.0))
    assert np.array_equal(share.rdp(l1=10, l2=3, survivors=5), skellam_rdp(l1=10, l2=3, variance=125.0))
    assert np.all(share.rdp(l1=10, l2=3, survivors=3) < share.rdp(l1=10, l2=3))


def test_samples_are_int64_and_fresh_on_every_call():
    share = SkellamShare(variance_total=20.0, threshold=2, participants=3)
    rng = SecureRandom()
    first, second = share.sample(1000, rng), share.sample(1000, rng)
    assert first.dtype == np.int64
    assert first.shape == (1000,)
    assert not np.array_equal(first, second)
    assert share.sample(0, rng).shape == (0,)


def test_seeded_streams_repeat_and_unseeded_ones_do_not():
    share = SkellamShare(variance_total=20.0, threshold=2, participants=3)
    a = share.sample(1000, SecureRandom.seeded(7))
    b = share.sample(1000, SecureRandom.seeded(7))
    c = share.sample(1000, SecureRandom.seeded(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(share.sample(1000, SecureRandom()), share.sample(1000, SecureRandom()))


@pytest.mark.parametrize("mean", [0.4, 5.0, 50.0, 5000.0])
def test_secure_skellam_matches_numpy_poisson_difference(mean):
    count = 20_000
    ours = SecureRandom.seeded(f"chi2-{mean}").skellam(mean, count)
    numpy_rng = np.random.default_rng(12345)
    theirs = numpy_rng.poisson(mean, count) - numpy_rng.poisson(mean, count)
    pooled = np.concatenate([ours, theirs])
    edges = np.unique(np.quantile(pooled, np.linspace(0, 1, 31)).round())
    edges[-1] += 1  # the last bin closed on the right
    table = np.array([np.histogram(ours, edges)[0], np.histogram(theirs, edges)[0]])
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 3
    _, p, _, expected = chi2_contingency(table)
    assert expected.min() >= 5
    assert p > 1e-3


# ---------------------------------------------------------------- headroom in the ring


@pytest.mark.parametrize("mean", [0.001, 0.4, 5.0, 500.0, 1e6])
@pytest.mark.parametrize("sigmas", [2.0, 3.0, 5.0])
def test_headroom_bounds_the_exact_skellam_tail(mean, sigmas):
    share = SkellamShare(variance_total=2 * mean * 3, threshold=3, participants=4)
    h = share.headroom(sigmas)
    total = share.participants * mean  # Poisson mean per side of the n silos' summed noise
    assert 2 * skellam.sf(h, total, total) <= math.exp(-(sigmas**2) / 2)
    sd = math.sqrt(2 * total)
    if mean >= 500:  # Gaussian-like: exp(−h²/2V) ≈ exp(−sigmas²/2)/2 puts h near √(sigmas² + 2 ln 2) sd
        assert sigmas * sd <= h <= 1.01 * math.sqrt(sigmas**2 + 2 * math.log(2)) * sd + 2
    if mean <= 0.4 and sigmas >= 5:  # the Poisson tail is heavier than a Gaussian's
        assert h > sigmas * sd


def test_headroom_holds_for_drawn_noise_and_is_zero_without_noise():
    share = SkellamShare(variance_total=30.0, threshold=3, participants=5)
    noise = sum(share.sample(50_000, SecureRandom.seeded(f"room-{i}")) for i in range(5))
    assert np.max(np.abs(noise)) <= share.headroom(6.0) < share.headroom()
    assert SkellamShare(variance_total=0.0, threshold=1, participants=3).headroom() == 0


# ---------------------------------------------------------------- sensitivities after rounding


def test_rounding_helpers_known_values():
    assert rounded_l2(10.0, 16) == 12.0  # 10 + √16/2
    assert l2_to_l1(3.0, 100) == 9.0  # min(10·3, 3²)
    assert l2_to_l1(30.0, 100) == 300.0  # min(10·30, 30²)


@given(
    data=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=64),
    scale=st.floats(0.1, 100.0),
)
@settings(max_examples=100, deadline=None, derandomize=True)
def test_rounded_vectors_obey_the_bounds(data, scale):
    x = np.array(data) * scale
    rounded = np.round(x)
    l2 = rounded_l2(float(np.linalg.norm(x)), len(x))
    assert np.linalg.norm(rounded) <= l2 * (1 + 1e-12)
    assert np.abs(rounded).sum() <= l2_to_l1(l2, len(x)) * (1 + 1e-12) + 1e-9


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variance_total": 10.0, "threshold": 0, "participants": 3}, "at least 1"),
        ({"variance_total": 10.0, "threshold": 4, "participants": 3}, "exceeds the n = 3"),
        ({"variance_total": -1.0, "threshold": 1, "participants": 3}, "variance is finite and >= 0"),
        ({"variance_total": math.nan, "threshold": 1, "participants": 3}, "variance is finite and >= 0"),
        ({"variance_total": 10.0, "threshold": 1.5, "participants": 3}, "whole number"),
        ({"variance_total": 10.0, "threshold": 1, "participants": True}, "whole number"),
    ],
)
def test_share_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SkellamShare(**kwargs)


def test_share_is_frozen():
    share = SkellamShare(variance_total=1.0, threshold=1, participants=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        share.threshold = 2  # type: ignore[misc]


def test_call_validation():
    share = SkellamShare(variance_total=10.0, threshold=2, participants=4)
    with pytest.raises(ValueError, match="between the threshold t = 2"):
        share.rdp(l1=1, l2=1, survivors=1)
    with pytest.raises(ValueError, match="n = 4 participants"):
        share.rdp(l1=1, l2=1, survivors=5)
    with pytest.raises(ValueError, match="sample count"):
        share.sample(-1, SecureRandom.seeded(0))
    with pytest.raises(ValueError, match="sigmas"):
        share.headroom(0)
    with pytest.raises(ValueError, match="L1 sensitivity"):
        skellam_rdp(l1=-1, l2=1, variance=1)
    with pytest.raises(ValueError, match="L2 sensitivity"):
        skellam_rdp(l1=1, l2=math.inf, variance=1)
    with pytest.raises(ValueError, match="Skellam variance"):
        skellam_rdp(l1=1, l2=1, variance=-2)
    with pytest.raises(ValueError, match="target ε"):
        skellam_variance_for(l1=1, l2=1, target_epsilon=0, delta=1e-5)
    with pytest.raises(ValueError, match="releases"):
        skellam_variance_for(l1=1, l2=1, target_epsilon=1, delta=1e-5, releases=0)
    with pytest.raises(ValueError, match="alone spend"):
        skellam_variance_for(
            l1=1, l2=1, target_epsilon=1, delta=1e-5, spent=gaussian_rdp(noise_multiplier=0.5)
        )
    with pytest.raises(ValueError, match="vector over the"):
        skellam_variance_for(l1=1, l2=1, target_epsilon=1, delta=1e-5, spent=np.zeros(3))
    with pytest.raises(ValueError, match="δ"):
        skellam_variance_for(l1=1, l2=1, target_epsilon=1, delta=0)
    with pytest.raises(ValueError, match="dimension"):
        l2_to_l1(1.0, 0)
    with pytest.raises(ValueError, match="L2 bound"):
        rounded_l2(-1.0, 4)
