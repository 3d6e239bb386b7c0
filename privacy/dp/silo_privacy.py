"""One silo's differential privacy for a run: DP-SGD's noise, sampling and budget (`PrivateRound`, for
`train_local`), its per-class record counts noised once, its share of noise on every statistic it releases in
a sum (`ReleaseNoise`, for the round driver), and the ledger that all of them are charged to first.

With `noise_multiplier = 0` the silo picks DP-SGD's σ itself: the smallest that keeps its whole plan — the
count release, the plan's statistics releases (`Method.statistics_plan`) at their noise, then every planned
round's DP-SGD steps at its own sampling rate — within the plan's ε, and within its budget ε together with
what earlier runs (other plans, by the ledger's run tags) already spent. That is a pure function of the
plan, the silo's data size and the earlier runs' spending, so a restarted silo picks the same σ; a plan that
asks for more rounds than it announced is still stopped by the ledger.

The statistics' noise multiplier must be the same at every silo (each adds a share of one target, and each
one's guarantee rests on the others' shares), so with `statistics_noise = 0` it is derived from the plan
alone: the smallest that keeps the count release and the plan's statistics releases within half of the
plan's ε, leaving the other half to DP-SGD.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlt.aggregation.halves import SumSpec
from privacy.dp.accountant import epsilon, gaussian_rdp, sgd_noise_for, sgd_rdp, smallest_noise
from privacy.dp.ledger import Budget, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.release import add_shares, noised_fields, release_rdp

COUNTS = "class counts"


class SiloPrivacy:
    def __init__(
        self,
        settings: Any,
        *,
        method: Any,
        ledger: PrivacyLedger,
        rng: SecureRandom | None = None,
        run: str = "",
    ) -> None:
        """`run` tags this plan's ledger entries (the consortium's plan digest; the simulator's ledgers hold
        one run each)."""
        self.settings = settings
        self.run = run
        self.rounds = method.rounds
        self.statistics, self.releases = method.statistics_plan()
        self.ledger = ledger
        self.rng = rng or SecureRandom()
        self.statistics_noise = settings.statistics_noise or _statistics_noise(
            settings.epsilon / 2, settings.delta, self.statistics, self.releases, tuple(self._counts_rdp())
        )

    @classmethod
    def open(
        cls, settings: Any, *, method: Any, ledger: Path | None, budget: Budget | None = None
    ) -> SiloPrivacy:
        budget = budget or Budget(settings.epsilon, settings.delta)
        return cls(settings, method=method, ledger=PrivacyLedger(budget, ledger))

    @property
    def max_grad_norm(self) -> float:
        return self.settings.max_grad_norm

    # --- DP-SGD ---------------------------------------------------------------------------------

    def admit_sgd(self, *, sample_rate: float, steps: int) -> float:
        sigma = self.noise_multiplier(sample_rate=sample_rate, steps=steps)
        self.ledger.charge(
            "dp-sgd",
            sgd_rdp(sample_rate=sample_rate, noise_multiplier=sigma, steps=steps),
            run=self.run,
            what=f"local training ({steps} steps)",
            sample_rate=round(sample_rate, 6),
            noise_multiplier=round(sigma, 4),
            max_grad_norm=self.max_grad_norm,
            steps=steps,
        )
        return sigma

    def noise_multiplier(self, *, sample_rate: float, steps: int) -> float:
        """σ of DP-SGD: the plan's, or the smallest that fits the planned rounds in the target ε."""
        if self.settings.noise_multiplier > 0:
            return self.settings.noise_multiplier
        planned = self._counts_rdp() + self.releases * release_rdp(self.statistics, self.statistics_noise)
        limits = [
            (self.settings.epsilon, planned),
            (self.ledger.budget.epsilon, planned + self.ledger.spent_rdp_outside(self.run)),
        ]
        finite = [(target, spent) for target, spent in limits if math.isfinite(target)] or limits
        delta, total_steps = self.ledger.budget.delta, steps * self.rounds
        return max(_calibrated(target, delta, sample_rate, total_steps, tuple(s)) for target, s in finite)

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        stream = self.rng.spawn()
        return lambda count, std: stream.gaussian((count,), std)

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        return self.rng.bernoulli(count, p)

    # --- what the silo reports -------------------------------------------------------------------

    def reported_counts(self, counts: np.ndarray) -> np.ndarray:
        """The class counts noised once per data (its records), whichever run or study of this silo noised
        them first: a fresh copy each time would let their average approach the truth. A draw the ledger
        finds already made is dropped unreleased."""
        records = [int(c) for c in counts]
        noise = self.rng.gaussian(torch.Size([len(records)]), self.settings.count_noise, torch.float64)
        entry = self.ledger.charge(
            "gaussian",
            self._counts_rdp(),
            run=self.run,
            what=COUNTS,
            once_per=("records",),
            std=self.settings.count_noise,
            records=records,
            reported=[round(r + float(e), 1) for r, e in zip(records, noise, strict=True)],
        )
        return np.array(entry["params"]["reported"], dtype=np.float64)

    def _counts_rdp(self) -> np.ndarray:
        """A record changes one class's count by one: L2 sensitivity 1."""
        return gaussian_rdp(noise_multiplier=self.settings.count_noise)

    def noised(self, spec: SumSpec, vector: torch.Tensor, *, counted: int) -> torch.Tensor:
        noised = noised_fields(spec.schema.fields, self.statistics_noise)
        if not noised:
            return vector
        self.ledger.charge(
            "skellam",
            release_rdp(spec.schema.fields, self.statistics_noise),
            run=self.run,
            what=f"statistics of {spec.round_id}",
            fields=[n.field.name for n in noised],
            noise=round(self.statistics_noise, 4),
            counted=counted,
            silos=len(spec.silos),
        )
        return add_shares(
            spec.schema,
            vector,
            multiplier=self.statistics_noise,
            counted=counted,
            participants=len(spec.silos),
            rng=self.rng,
        )


@functools.lru_cache(maxsize=64)
def _statistics_noise(
    target: float, delta: float, fields: tuple, releases: int, counts_rdp: tuple[float, ...]
) -> float:
    """The smallest multiplier (to 0.1%) whose `releases` releases of `fields`, after the count release,
    stay within `target`; 1 when the plan releases no statistics (it is never used then)."""
    if not releases or not noised_fields(fields, 1.0):
        return 1.0
    base = np.array(counts_rdp)
    if epsilon(base, delta) >= target:
        raise ValueError(f"the count release alone spends more than ε = {target:g}")

    def fits(multiplier: float) -> bool:
        return epsilon(base + releases * release_rdp(fields, multiplier), delta) <= target

    return smallest_noise(
        fits, limit=1e6, what=f"no noise on the statistics keeps them within ε = {target:g}"
    )


@functools.lru_cache(maxsize=64)
def _calibrated(target: float, delta: float, rate: float, steps: int, planned: tuple[float, ...]) -> float:
    if not math.isfinite(target):
        raise ValueError("a finite ε is needed to pick σ")
    return sgd_noise_for(
        target_epsilon=target, delta=delta, sample_rate=rate, steps=steps, spent=np.array(planned)
    )
