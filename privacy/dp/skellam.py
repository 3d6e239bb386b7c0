"""The distributed Skellam mechanism: integer noise that survives secure aggregation's modular sum.

Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated Learning" (NeurIPS
2021, arXiv:2110.04995). Silos hold integer vectors (fixed point: value·2^f, rounded), each adds its own
share of Skellam noise, and secure aggregation reveals only the sum. Skellam(μ, μ) = Poisson(μ) − Poisson(μ)
is symmetric with variance 2μ, and independent Skellams add up to a Skellam whose μ is the sum, so the
released sum carries Skellam noise of variance Σ 2μ_i: unlike the distributed discrete Gaussian, no slack
for "a sum of discrete Gaussians is not a discrete Gaussian" to account for.

Units: every sensitivity and variance here is in units of the integer grid (the field's 2^−f), i.e. what the
silos actually add. A real-valued L2 clip c becomes c·2^f units, plus the rounding slack of `rounded_l2`.

Dropouts: each silo adds variance target/t, so any t of the n silos (a secure aggregation threshold) already
reach the target; more survivors only add noise (`SkellamShare.rdp(survivors=...)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privacy.dp.accountant import ORDERS, epsilon, orders, smallest_noise
from privacy.dp.noise import SecureRandom


def skellam_rdp(*, l1: float, l2: float, variance: float) -> np.ndarray:
    """RDP ε(α) over `ORDERS` of one release of an integer vector plus Skellam noise of per-coordinate
    `variance` (the total at the sum), for L1 / L2 sensitivities `l1`, `l2` (grid units).

    Agarwal, Kairouz & Liu 2021, RDP of the multi-dimensional Skellam mechanism (Corollary 3.6 of
    arXiv:2110.04995v2; it sums their one-dimensional bound on the Rényi divergence of two shifted
    Skellams over the coordinates), written with μ = the variance of the noise:

        ε(α) ≤ α·Δ2² / (2μ) + min( ((2α − 1)·Δ2² + 6·Δ1) / (4μ²),  3·Δ1 / (2μ) )

    The first term is the Gaussian mechanism's α·Δ2²/(2σ²); the second vanishes as μ grows, so large noise
    costs what the Gaussian costs. The bound is proved for integer α > 1 only: for a fractional order we
    report it at ⌈α⌉, a valid upper bound because Rényi divergence is non-decreasing in α.
    """
    _check_sensitivities(l1, l2)
    if not variance >= 0 or not math.isfinite(variance):
        raise ValueError(f"a Skellam variance is finite and >= 0, got {variance}")
    if l1 == 0 and l2 == 0:
        return np.zeros(len(ORDERS))
    if variance == 0:
        return np.full(len(ORDERS), math.inf)
    alpha = np.ceil(orders())
    gaussian = alpha * l2**2 / (2 * variance)
    discrete = np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance))
    return gaussian + discrete


def skellam_variance_for(
    *,
    l1: float,
    l2: float,
    target_epsilon: float,
    delta: float,
    releases: int = 1,
    spent: np.ndarray | None = None,
) -> float:
    """The smallest Skellam variance (to 0.1%, rounded up) whose `releases` releases, added to the RDP already
    `spent`, stay within `target_epsilon` at `delta`; raises ValueError if none does.

    RDP composes by addition, so `releases` releases cost `releases`·`skellam_rdp`; the bisection mirrors
    `sgd_noise_for` and always returns a variance that fits, never one just below the budget's edge.
    """
    _check_sensitivities(l1, l2)
    if not target_epsilon > 0:
        raise ValueError(f"a target ε is > 0, got {target_epsilon}")
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ValueError(f"the number of releases is an integer >= 1, got {releases!r}")
    base = np.zeros(len(ORDERS)) if spent is None else np.asarray(spent, dtype=np.float64)
    if base.shape != (len(ORDERS),):
        raise ValueError(f"spent RDP is a vector over the {len(ORDERS)} accountant orders, got {base.shape}")
    already = epsilon(base, delta)
    if already >= target_epsilon:
        raise ValueError(
            f"the other releases alone spend ε = {already:.3g} of the ε = {target_epsilon:g} budget"
        )
    if l1 == 0 and l2 == 0:
        return 0.0

    def fits(variance: float) -> bool:
        rdp = base + releases * skellam_rdp(l1=l1, l2=l2, variance=variance)
        return epsilon(rdp, delta) <= target_epsilon

    return smallest_noise(fits, limit=1e30, what=f"no Skellam variance reaches ε = {target_epsilon:g}")


def l2_to_l1(l2: float, dims: int) -> float:
    """An L1 bound for an integer vector of `dims` coordinates whose L2 norm is at most `l2` (grid units).

    Cauchy–Schwarz gives ‖x‖1 ≤ √d·‖x‖2 for any vector; for an integer one |x_i| ≤ x_i², so also
    ‖x‖1 ≤ ‖x‖2². The Skellam paper (and Google's accounting) uses Δ1 ≤ min(√d·Δ2, Δ2²) this way.
    Pass the L2 bound after rounding (`rounded_l2`): only the rounded vector is integer.
    """
    _check_dims(dims)
    if not l2 >= 0 or not math.isfinite(l2):
        raise ValueError(f"an L2 bound is finite and >= 0, got {l2}")
    return min(math.sqrt(dims) * l2, l2 * l2)


def rounded_l2(l2_units: float, dims: int) -> float:
    """The L2 bound, in grid units, of a `dims`-coordinate vector of L2 norm ≤ `l2_units` after deterministic
    rounding of each coordinate to the nearest integer.

    Each coordinate moves by at most 1/2, so the rounding error has L2 norm ≤ √d/2 and, by the triangle
    inequality, ‖round(x)‖2 ≤ ‖x‖2 + √d/2. The paper instead reuses the conditional randomized rounding of
    Kairouz, Liu & Steinke 2021 (arXiv:2102.06387, Theorem 1: error below 1 per coordinate, so a norm bound of
    ‖x‖2 + √d, or a tighter one that holds except with probability β, enforced by resampling); deterministic
    rounding needs neither β nor resampling, and a fine grid (many units per unit of clip norm) makes the
    √d/2 slack small next to the clip. It is the sensitivity only if each protected contribution is rounded
    on its own before it is summed: for a rounded sum, round(S + x) − round(S) can be off by up to 1 per
    coordinate, i.e. ‖x‖2 + √d.
    """
    _check_dims(dims)
    if not l2_units >= 0 or not math.isfinite(l2_units):
        raise ValueError(f"an L2 bound is finite and >= 0, got {l2_units}")
    return l2_units + math.sqrt(dims) / 2


@dataclass(frozen=True)
class SkellamShare:
    """One silo's share of distributed Skellam noise: n silos each add Skellam(μ, μ), and any `threshold` (t)
    of the `participants` (n) together reach `variance_total` (t · 2μ = variance_total)."""

    variance_total: float
    threshold: int
    participants: int

    def __post_init__(self) -> None:
        for name in ("threshold", "participants"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"the {name} is a whole number of silos, got {value!r}")
        if self.threshold < 1:
            raise ValueError(f"the threshold t is at least 1 silo, got {self.threshold}")
        if self.threshold > self.participants:
            raise ValueError(
                f"the threshold t = {self.threshold} exceeds the n = {self.participants} participants"
            )
        if not self.variance_total >= 0 or not math.isfinite(self.variance_total):
            raise ValueError(f"the total noise variance is finite and >= 0, got {self.variance_total}")

    @property
    def per_silo_mean(self) -> float:
        """The Poisson mean μ of each silo's Skellam(μ, μ): t silos give variance t·2μ = variance_total."""
        return self.variance_total / (2 * self.threshold)

    def variance_with(self, survivors: int) -> float:
        """The per-coordinate noise variance at the sum when `survivors` silos' shares reach it."""
        if isinstance(survivors, bool) or not isinstance(survivors, int | np.integer):
            raise ValueError(f"survivors is a whole number of silos, got {survivors!r}")
        if not self.threshold <= survivors <= self.participants:
            raise ValueError(
                f"survivors must be between the threshold t = {self.threshold} and the "
                f"n = {self.participants} participants, got {survivors}"
            )
        return survivors * 2 * self.per_silo_mean

    def sample(self, count: int, rng: SecureRandom) -> np.ndarray:
        """This silo's noise for `count` coordinates: int64 Skellam(μ, μ) draws from the cipher keystream."""
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(f"a sample count is an integer >= 0, got {count!r}")
        return rng.skellam(self.per_silo_mean, int(count)).astype(np.int64, copy=False)

    def rdp(self, *, l1: float, l2: float, survivors: int | None = None) -> np.ndarray:
        """The RDP of one release when only `survivors` (default t, the worst case secure aggregation allows)
        silos' noise reaches the sum: Skellam of variance survivors·2μ (`skellam_rdp`)."""
        survivors = self.threshold if survivors is None else survivors
        return skellam_rdp(l1=l1, l2=l2, variance=self.variance_with(survivors))

    def headroom(self, sigmas: float = 20) -> int:
        """An integer h such that the noise of all n silos, per coordinate, has |noise| ≤ h except with
        probability at most exp(−sigmas²/2) (a Gaussian's tail bound at `sigmas` standard deviations): the
        smallest h for which the Chernoff bound below certifies it.

        The sum is Skellam(m, m) with m = n·μ, whose moment generating function is exp(2m(cosh λ − 1)). The
        Chernoff bound, at its best λ = asinh(k/2m), gives P(X ≥ k) ≤ exp(−I(k)) with
        I(k) = 2m·(x·asinh x − (√(1 + x²) − 1)), x = k/(2m); with symmetry P(|X| ≥ k) ≤ 2·exp(−I(k)). For
        large m, I(k) ≈ k²/(2·variance), so h ≈ sigmas standard deviations; for small m the Poisson tail is
        heavier than a Gaussian's, and h grows accordingly (a plain sigmas·σ would be wrong there). The bound
        is per coordinate: over d coordinates the union bound multiplies the probability by d (20 sigmas give
        e^−200, negligible for any d). Size the ring so that n·(largest |value|) + h stays below half of 2^64.
        """
        if not sigmas > 0 or not math.isfinite(sigmas):
            raise ValueError(f"sigmas is finite and > 0, got {sigmas}")
        m = self.participants * self.per_silo_mean
        if m == 0:
            return 0
        needed = sigmas**2 / 2 + math.log(2)

        def exponent(k: float) -> float:
            x = k / (2 * m)
            return 2 * m * (x * math.asinh(x) - x * x / (math.sqrt(1 + x * x) + 1))

        low, high = 0, max(1, math.ceil(sigmas * math.sqrt(2 * m)))  # P(|X| >= high) small enough
        while exponent(high) < needed:
            low, high = high, 2 * high
        while high - low > 1:  # invariant: exponent(low) < needed <= exponent(high), or low = 0
            mid = (low + high) // 2
            low, high = (low, mid) if exponent(mid) >= needed else (mid, high)
        return high - 1


def _check_sensitivities(l1: float, l2: float) -> None:
    for name, value in (("L1", l1), ("L2", l2)):
        if not value >= 0 or not math.isfinite(value):
            raise ValueError(f"an {name} sensitivity is finite and >= 0, got {value}")


def _check_dims(dims: int) -> None:
    if isinstance(dims, bool) or not isinstance(dims, int | np.integer) or dims < 1:
        raise ValueError(f"a dimension is an integer >= 1, got {dims!r}")
