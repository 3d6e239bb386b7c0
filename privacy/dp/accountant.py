"""One accountant for every mechanism a silo runs: Rényi DP at a fixed list of orders, composed by addition.

DP-SGD's sampled Gaussian comes from Opacus' RDP analysis (Mironov, Talwar & Zhang 2019), the releases of
statistics from the Skellam bound (`privacy.dp.skellam`); both are vectors over `ORDERS`, so a ledger adds
them up and converts the total to (ε, δ) once, with Opacus' conversion (Balle et al. 2020, Theorem 21).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import numpy as np
from opacus.accountants.analysis import rdp as opacus_rdp

# Opacus' RDP accountant's orders (opacus/accountants/rdp.py DEFAULT_ALPHAS), extended for small budgets
ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *(float(a) for a in range(12, 64)),
    128.0,
    256.0,
)


def orders() -> np.ndarray:
    return np.array(ORDERS)


def sgd_rdp(*, sample_rate: float, noise_multiplier: float, steps: int) -> np.ndarray:
    """`steps` of the Poisson-subsampled Gaussian mechanism with this rate and σ (clip norm 1)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"a sample rate is in (0, 1], got {sample_rate}")
    if noise_multiplier <= 0:
        return np.full(len(ORDERS), math.inf)
    return steps * np.array(_sgd_step_rdp(sample_rate, noise_multiplier))


@functools.lru_cache(maxsize=4096)
def _sgd_step_rdp(sample_rate: float, noise_multiplier: float) -> tuple[float, ...]:
    """One step's RDP, remembered: Opacus' series for fractional orders takes about 0.2 s a call, and a
    silo asks for the same (rate, σ) every round. Steps compose linearly, as in Opacus' `compute_rdp`."""
    rdp = opacus_rdp.compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(ORDERS)
    )
    return tuple(float(r) for r in rdp)


def gaussian_rdp(*, noise_multiplier: float) -> np.ndarray:
    """One release of the Gaussian mechanism with std = noise_multiplier × L2 sensitivity: α / (2σ²)."""
    if noise_multiplier <= 0:
        return np.full(len(ORDERS), math.inf)
    return orders() / (2 * noise_multiplier**2)


def epsilon(rdp: np.ndarray, delta: float) -> float:
    """The ε of (ε, δ)-DP implied by the RDP curve `rdp` (inf where nothing bounds it)."""
    if not 0 < delta < 1:
        raise ValueError(f"δ is in (0, 1), got {delta}")
    if not np.any(np.isfinite(rdp)):
        return math.inf
    if not np.any(rdp > 0):
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns when the best order is an end of the list
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(ORDERS), rdp=np.asarray(rdp), delta=delta)
    return float(eps)


def sgd_noise_for(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int, spent: np.ndarray | None = None
) -> float:
    """The smallest DP-SGD σ (to 0.1%) whose `steps` at `sample_rate`, added to `spent`, stay within
    `target_epsilon`; raises ValueError if none does (the other releases alone exceed the budget)."""
    base = np.zeros(len(ORDERS)) if spent is None else spent
    if epsilon(base, delta) >= target_epsilon:
        raise ValueError(
            f"the other releases alone spend ε = {epsilon(base, delta):.3g} "
            f"of the ε = {target_epsilon:g} budget"
        )

    def fits(sigma: float) -> bool:
        rdp = base + sgd_rdp(sample_rate=sample_rate, noise_multiplier=sigma, steps=steps)
        return epsilon(rdp, delta) <= target_epsilon

    return smallest_noise(fits, limit=1e6, what=f"no noise multiplier reaches ε = {target_epsilon:g}")


def smallest_noise(fits: Callable[[float], bool], *, limit: float, what: str) -> float:
    """The smallest noise (to 0.1%, rounded up) that `fits`, which must be monotone: doubling from 1 to
    bracket it, then bisecting; never returns a value that does not fit. ValueError(`what`) past `limit`."""
    low, high = 0.0, 1.0
    while not fits(high):
        low, high = high, 2 * high
        if high > limit:
            raise ValueError(what)
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high
