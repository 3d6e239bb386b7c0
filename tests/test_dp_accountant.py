import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.stats import norm

from privacy.dp.accountant import ORDERS, epsilon, gaussian_rdp, orders, sgd_noise_for, sgd_rdp

ALPHA = orders()
MNIST = 60_000
MNIST_BATCH = 256
STEPS_PER_EPOCH = MNIST // MNIST_BATCH  # the tutorial's `steps_per_epoch = 60000 // FLAGS.batch_size`


def _mironov_epsilon(rdp: np.ndarray, delta: float, max_order: float = 63.0) -> float:
    """ε = min_α RDP(α) + log(1/δ)/(α − 1) (Mironov 2017, Prop. 3), the conversion TF Privacy's
    `rdp_accountant.get_privacy_spent` used in 2019, over that accountant's orders (1.1 … 10.9, 12 … 63)."""
    keep = max_order >= ALPHA
    return float(np.min(rdp[keep] + math.log(1 / delta) / (ALPHA[keep] - 1)))


def _google_epsilon(
    sample_rate: float, noise_multiplier: float, steps: int, delta: float, orders=None
) -> float:
    """ε from Google's dp_accounting: `steps` Poisson-sampled Gaussians in its own RDP accountant."""
    accountant = rdp_privacy_accountant.RdpAccountant(orders=orders)
    event = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


# ---------------------------------------------------------------- published numbers


# TensorFlow Privacy, tutorials/README.md, "Select Parameters" table and compute_dp_sgd_privacy example
# (https://github.com/tensorflow/privacy/blob/d435fcbf9af0d1ffd41ebc15ae23595124f7aa73/tutorials/README.md):
# MNIST, N = 60000, batch 256, δ = 1e-5; (noise multiplier, epochs) → published ε
TF_PRIVACY_README = [(1.1, 60, 3.01), (1.3, 15, 1.19), (0.7, 45, 7.10)]


@pytest.mark.parametrize(("noise_multiplier", "epochs", "published"), TF_PRIVACY_README)
def test_rdp_curve_reproduces_tf_privacy_mnist_tutorial(noise_multiplier, epochs, published):
    """Guards the DP-SGD RDP curve against a published answer: TensorFlow Privacy's MNIST tutorial README
    (github.com/tensorflow/privacy, tutorials/README.md at d435fcb: σ = 1.1, batch 256, 60 epochs of 60000
    examples, δ = 1e-5 → ε = 3.01; also σ = 1.3 / 15 epochs → 1.19 and σ = 0.7 / 45 epochs → 7.10).

    Those numbers came from Mironov's (ε, δ) conversion over TF's order grid, so our curve converted the
    same way must give them to the README's two decimals (±0.005, plus 0.001 for float noise). Our own
    `epsilon` uses the tighter conversion of Balle et al. 2020 (Thm 21), so it must come out below the
    published figure, but not by more than a quarter (the two conversions differ by log terms of the best
    order, about 10–20 % here; a larger gap would mean a wrong curve, e.g. a wrong step count)."""
    steps = epochs * STEPS_PER_EPOCH
    rdp = sgd_rdp(sample_rate=MNIST_BATCH / MNIST, noise_multiplier=noise_multiplier, steps=steps)
    assert _mironov_epsilon(rdp, 1e-5) == pytest.approx(published, abs=0.006)
    ours = epsilon(rdp, 1e-5)
    assert 0.75 * published < ours < published


# ---------------------------------------------------------------- against Google's dp_accounting

SGD_SETTINGS = [
    # (sample rate q, noise multiplier σ, steps)
    (MNIST_BATCH / MNIST, 1.1, 60 * STEPS_PER_EPOCH),
    (0.01, 1.0, 1000),
    (0.05, 1.0, 200),
    (0.2, 2.0, 50),
    (0.02, 4.0, 10),
    (1.0, 5.0, 3),
]


@pytest.mark.parametrize(("q", "sigma", "steps"), SGD_SETTINGS)
def test_sgd_epsilon_matches_google_dp_accounting(q, sigma, steps):
    """Guards against a miscounted DP-SGD ε (wrong composition, rate or conversion) by an independent
    implementation: dp_accounting's RdpAccountant with PoissonSampledDpEvent(q, GaussianDpEvent(σ))
    composed `steps` times. On its own default order grid it may differ from ours only by where the grids
    put their orders (≤ 1 %); on our grid the two must agree to 1e-6, unless dp_accounting gave up on a
    fractional order's series and dropped it (then it can only be the larger)."""
    ours = epsilon(sgd_rdp(sample_rate=q, noise_multiplier=sigma, steps=steps), 1e-5)
    assert ours == pytest.approx(_google_epsilon(q, sigma, steps, 1e-5), rel=0.01)
    same_grid = _google_epsilon(q, sigma, steps, 1e-5, orders=list(ORDERS))
    assert ours <= same_grid * (1 + 1e-6)
    assert ours == pytest.approx(same_grid, rel=0.002)


def _sampled_gaussian_rdp_by_quadrature(q: float, sigma: float, alpha: float) -> float:
    """RDP of order α of one Poisson-sampled Gaussian (Mironov, Talwar & Zhang 2019, §3):
    log E_{z ~ N(0, σ²)}[((1 − q) + q·exp((2z − 1)/(2σ²)))^α] / (α − 1), integrated numerically."""

    def integrand(z: float) -> float:
        return norm.pdf(z, scale=sigma) * ((1 - q) + q * math.exp((2 * z - 1) / (2 * sigma**2))) ** alpha

    # the integrand peaks near z = α·q-ish … α; 25σ either side holds all of its mass
    value, _ = integrate.quad(
        integrand,
        -25 * sigma,
        alpha + 25 * sigma,
        points=[0.0, 0.5, alpha],
        epsabs=0,
        epsrel=1e-11,
        limit=400,
    )
    return math.log(value) / (alpha - 1)


@pytest.mark.parametrize(
    ("q", "sigma", "alpha"),
    [(0.5, 0.6, 1.1), (0.5, 0.6, 1.5), (0.5, 0.6, 3.0), (0.05, 1.0, 1.3), (0.05, 1.0, 7.5), (0.2, 2.0, 20.0)],
)
def test_sgd_rdp_matches_numerical_integration(q, sigma, alpha):
    """Guards each order of the subsampled-Gaussian curve, fractional ones included, against the definition
    itself, integrated by quadrature. (Where q is large and σ small, dp_accounting drops low fractional
    orders whose series does not converge and reports a larger ε; this shows ours are still right.)"""
    (index,) = np.flatnonzero(np.isclose(ALPHA, alpha))
    ours = sgd_rdp(sample_rate=q, noise_multiplier=sigma, steps=1)[index]
    assert ours == pytest.approx(_sampled_gaussian_rdp_by_quadrature(q, sigma, alpha), rel=1e-6)


def test_sgd_rdp_is_linear_in_steps_and_is_the_gaussian_at_rate_one():
    """Guards composition (T steps cost T times one step) and the q = 1 end, where no sampling amplifies
    and the mechanism is the plain Gaussian, α/(2σ²)."""
    one = sgd_rdp(sample_rate=0.03, noise_multiplier=1.3, steps=1)
    np.testing.assert_allclose(
        sgd_rdp(sample_rate=0.03, noise_multiplier=1.3, steps=37), 37 * one, rtol=1e-12
    )
    np.testing.assert_allclose(
        sgd_rdp(sample_rate=1.0, noise_multiplier=1.7, steps=1),
        gaussian_rdp(noise_multiplier=1.7),
        rtol=1e-12,
    )


def test_sgd_rdp_limits():
    """Guards the edges: no noise is unbounded, and a rate outside (0, 1] is an error, not a number."""
    assert np.all(np.isinf(sgd_rdp(sample_rate=0.1, noise_multiplier=0.0, steps=5)))
    for rate in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="sample rate"):
            sgd_rdp(sample_rate=rate, noise_multiplier=1.0, steps=5)


# ---------------------------------------------------------------- the Gaussian mechanism


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0, 10.0])
def test_gaussian_rdp_closed_form_and_dp_accounting(sigma):
    """Guards the count release's cost: RDP(α) = α/(2σ²) at every order (Mironov 2017, Prop. 7), and the
    same ε as dp_accounting's GaussianDpEvent on the same orders (to 1e-9) and on its own grid (1 %)."""
    rdp = gaussian_rdp(noise_multiplier=sigma)
    np.testing.assert_allclose(rdp, np.array(ORDERS) / (2 * sigma**2), rtol=1e-15)
    ours = epsilon(rdp, 1e-5)
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    assert ours == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    default_grid = rdp_privacy_accountant.RdpAccountant()
    default_grid.compose(dp_accounting.GaussianDpEvent(sigma))
    assert ours == pytest.approx(default_grid.get_epsilon(1e-5), rel=0.01)


def test_gaussian_rdp_without_noise_is_unbounded():
    """Guards against σ = 0 being read as free: it is an infinite cost, which any ledger refuses."""
    assert np.all(np.isinf(gaussian_rdp(noise_multiplier=0.0)))
    assert epsilon(gaussian_rdp(noise_multiplier=0.0), 1e-5) == math.inf


# ---------------------------------------------------------------- epsilon


def test_epsilon_of_nothing_and_of_everything():
    """Guards the ends of the conversion: no spending is ε = 0, unbounded spending is ε = inf, and one
    finite order is enough to bound ε."""
    assert epsilon(np.zeros(len(ORDERS)), 1e-5) == 0.0
    assert epsilon(np.full(len(ORDERS), math.inf), 1e-5) == math.inf
    partly = np.full(len(ORDERS), math.inf)
    partly[10] = 0.5
    assert 0 < epsilon(partly, 1e-5) < math.inf


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 1.5])
def test_epsilon_refuses_delta_outside_unit_interval(delta):
    """Guards against a meaningless δ giving a number."""
    with pytest.raises(ValueError, match="δ"):
        epsilon(gaussian_rdp(noise_multiplier=1.0), delta)


def test_epsilon_decreases_with_delta_and_noise():
    """Guards the direction of the conversion: a larger δ or more noise can only lower ε."""
    rdp = sgd_rdp(sample_rate=0.01, noise_multiplier=1.0, steps=100)
    assert epsilon(rdp, 1e-3) < epsilon(rdp, 1e-5) < epsilon(rdp, 1e-8)
    more_noise = sgd_rdp(sample_rate=0.01, noise_multiplier=1.5, steps=100)
    assert epsilon(more_noise, 1e-5) < epsilon(rdp, 1e-5)


# ---------------------------------------------------------------- sgd_noise_for


def _sgd_epsilon(sigma: float, *, rate: float, steps: int, delta: float, spent=None) -> float:
    base = np.zeros(len(ORDERS)) if spent is None else spent
    return epsilon(base + sgd_rdp(sample_rate=rate, noise_multiplier=sigma, steps=steps), delta)


@given(
    target=st.floats(0.5, 8.0),
    rate=st.floats(0.002, 0.05),
    steps=st.integers(1, 400),
)
@settings(max_examples=5, deadline=None, derandomize=True)
def test_sgd_noise_for_fits_and_is_minimal(target, rate, steps):
    """Guards the calibration both ways: the σ found never overshoots the target ε (privacy), and 1 % less
    noise does overshoot it (utility: the search returns the smallest σ, to its 0.1 % tolerance)."""
    sigma = sgd_noise_for(target_epsilon=target, delta=1e-5, sample_rate=rate, steps=steps)
    assert _sgd_epsilon(sigma, rate=rate, steps=steps, delta=1e-5) <= target
    assert _sgd_epsilon(0.99 * sigma, rate=rate, steps=steps, delta=1e-5) > target


def test_sgd_noise_for_honours_what_was_spent():
    """Guards against calibrating DP-SGD as if the other releases (the noised count) were free: with them
    counted, σ is larger, the total fits the target and 1 % less noise would not."""
    spent = gaussian_rdp(noise_multiplier=4.0)
    kwargs = {"target_epsilon": 2.0, "delta": 1e-5, "sample_rate": 0.02, "steps": 150}
    alone = sgd_noise_for(**kwargs)
    sigma = sgd_noise_for(**kwargs, spent=spent)
    assert sigma > 1.01 * alone
    assert _sgd_epsilon(sigma, rate=0.02, steps=150, delta=1e-5, spent=spent) <= 2.0
    assert _sgd_epsilon(0.99 * sigma, rate=0.02, steps=150, delta=1e-5, spent=spent) > 2.0


def test_sgd_noise_for_refuses_when_the_rest_alone_exceeds_the_target():
    """Guards against returning some σ when no σ can fit: the other releases already spend the budget."""
    spent = gaussian_rdp(noise_multiplier=0.5)  # ε ≈ 10 on its own
    assert epsilon(spent, 1e-5) > 1.0
    with pytest.raises(ValueError, match="alone"):
        sgd_noise_for(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10, spent=spent)
