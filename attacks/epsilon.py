"""An empirical lower bound on the ε of a silo's DP-SGD, from one training run with canaries.

Method: Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), white-box
setting with gradient (Dirac) canaries. The model gets a block of m extra coordinates that no record's loss
reaches; canary j stands for a record whose clipped gradient is always C·e_j. Each canary is put in the data
with probability 1/2 (the audit's seeded RNG). The silo's own `SiloPrivacy` then runs `train_private` as local
training does: its CSPRNG Poisson-samples the real records and the canaries together (one `bernoulli` draw
of n + m), its noise stream adds σ·C noise to every coordinate, canaries' included, and σ comes from its
accountant, which charges the steps to its ledger. A sampled canary's gradient C·e_j joins the records'
clipped sum before the noise (`train_private`'s `after_clipping`), so it takes a record's path through the
noise and the division by the expected batch. The silo's CSPRNG is keyed from the audit's seed
(`SecureRandom.seeded`, as benchmarks do), so a report can be reproduced.

What it exercises: the sampler, the noise and its scale, the division by the expected batch size and the σ
the accountant picks. What it does not: the per-record clipping of real records (tests/test_dp_clipping.py
and tests/test_dp_sgd.py cover it), nor noise on released statistics.

Scores, guesses and the bound they give: `attacks.one_run` (the score of canary j is its coordinate's
descent, −θ_T[j]; it starts at 0). The no-noise control is the same run with the noise stream giving zeros
while the ledger still books σ: it is not private at all, and its bound reaching its ceiling shows the audit
has the power to see a leak.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from attacks.one_run import CONFIDENCE, best_guesses, reachable
from fedlt.dp import DPSettings
from fedlt.methods import TrainConfig
from fedlt.methods.dpsgd import train_private
from fedlt.methods.local import PrivateRound, cross_entropy
from privacy.dp.accountant import epsilon as rdp_epsilon
from privacy.dp.accountant import sgd_rdp
from privacy.dp.ledger import Budget, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.silo_privacy import SiloPrivacy

# --- the run ----------------------------------------------------------------------------------------------


class WithCanaries(nn.Module):
    """`model` and a block of canary coordinates, starting at 0, that its forward pass never reads: the
    weight of a linear layer that never runs (DP-SGD's clipping hooks every layer with parameters, and a
    layer it knows; one that never runs gets noise only)."""

    def __init__(self, model: nn.Module, canaries: int) -> None:
        super().__init__()
        self.model = model
        self.block = nn.Linear(canaries, 1, bias=False)
        nn.init.zeros_(self.block.weight)

    @property
    def canaries(self) -> nn.Parameter:
        return self.block.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class CanaryRound:
    """A `PrivateRound` that lets the silo's own sampler draw the canaries' batches: each `bernoulli(n, p)`
    draws n + m from the real one, gives back the records' n and keeps the canaries' m; `add_canaries`
    (DP-SGD's `after_clipping` hook) then adds C·e_j to the clipped sum for every canary inserted and
    sampled this step, before the noise and the division by the expected batch, as a record's clipped
    gradient goes (a canary added after them took its own path: a DP-SGD that noised only gradients no
    record reaches, or divided by another rate than it booked, passed)."""

    def __init__(self, private: PrivateRound, parameter: nn.Parameter, inserted: np.ndarray) -> None:
        self._private = private
        self._parameter = parameter
        self._inserted = torch.from_numpy(inserted).view_as(parameter)
        self._sampled: torch.Tensor | None = None
        self.admitted: tuple[float, float, int] | None = None  # (sample rate, σ, steps)

    @property
    def max_grad_norm(self) -> float:
        return self._private.max_grad_norm

    def admit_sgd(self, *, sample_rate: float, steps: int) -> float:
        sigma = self._private.admit_sgd(sample_rate=sample_rate, steps=steps)
        self.admitted = (sample_rate, sigma, steps)
        return sigma

    def reported_counts(self, counts: np.ndarray) -> np.ndarray:
        return self._private.reported_counts(counts)

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        return self._private.noise_stream()

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        mask = self._private.bernoulli(count + self._inserted.numel(), p)
        self._sampled = torch.from_numpy(mask[count:]).view_as(self._inserted)
        return mask[:count]

    def add_canaries(self) -> None:
        if self._sampled is None:
            raise RuntimeError("a DP-SGD step ran before its batch was sampled")
        parameter = self._parameter
        hits = (self._sampled & self._inserted).to(parameter.dtype).to(parameter.device)
        clipped = hits * self.max_grad_norm  # each sampled canary's gradient, C·e_j, at its clipping norm
        parameter.grad = clipped if parameter.grad is None else parameter.grad.add_(clipped)
        self._sampled = None


class NoiseOff:
    """The control: the silo's `PrivateRound` with its noise stream giving zeros (σ still booked)."""

    def __init__(self, private: PrivateRound) -> None:
        self._private = private

    def __getattr__(self, name: str):
        return getattr(self._private, name)

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        return lambda count, _std: torch.zeros(count)


@dataclass(frozen=True)
class EpsilonAudit:
    """One audited DP-SGD run. `target`: the plan's ε (None where the caller gave only a `PrivateRound`);
    `charged`: the ε the accountant charged for these DP-SGD steps alone (≤ target: the plan also books its
    counts); `lower_bound`: what the canaries prove at `confidence`; `ceiling`: the most this many canaries
    can prove. `control`: the noise was off, so the bound should reach the ceiling."""

    target: float | None
    delta: float
    charged: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    canaries: int
    inserted: int
    guesses: int
    correct: int
    lower_bound: float
    ceiling: float
    confidence: float
    control: bool
    seconds: float

    @property
    def violated(self) -> bool:
        """The run leaks more than its ledger says: its lower bound passes the charged ε (the audit's failure;
        not a test of the control, whose ceiling may lie under what it books)."""
        return self.lower_bound > self.charged

    @property
    def at_ceiling(self) -> bool:
        """Every guess of the best count was right: the most this audit can show (the control's pass)."""
        return self.correct == self.guesses and self.lower_bound >= self.ceiling

    def describe(self) -> str:
        what = "no-noise control" if self.control else "DP-SGD"
        if self.target is not None:
            what += f" at ε = {self.target:g}"
        return (
            f"{what}: ε ≥ {self.lower_bound:.2f} at {self.confidence:.0%} (ceiling {self.ceiling:.2f}) "
            f"against {self.charged:.2f} charged for {self.steps} DP-SGD steps "
            f"(σ = {self.noise_multiplier:.3g}, q = {self.sample_rate:.3g}, δ = {self.delta:g}); "
            f"{self.correct} of {self.guesses} guesses "
            f"right over {self.canaries} canaries"
        )


def audit_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    private: PrivateRound,
    *,
    delta: float,
    canaries: int,
    seed: int,
    train: TrainConfig,
    target: float | None = None,
    control: bool = False,
    confidence: float = CONFIDENCE,
) -> EpsilonAudit:
    """Train a copy of `model` on (x, y) with `private`'s DP-SGD and `canaries` canaries, and bound its ε."""
    if canaries < 1:
        raise ValueError(f"an audit needs at least one canary, got {canaries}")
    started = time.perf_counter()
    inserted = np.random.default_rng(seed).random(canaries) < 0.5
    audited = WithCanaries(copy.deepcopy(model), canaries)
    round_ = CanaryRound(private, audited.canaries, inserted)
    train_private(audited, x, y, train, round_, loss=cross_entropy, after_clipping=round_.add_canaries)
    assert round_.admitted is not None  # train_private admits its steps before taking any
    rate, sigma, steps = round_.admitted
    charged = rdp_epsilon(sgd_rdp(sample_rate=rate, noise_multiplier=sigma, steps=steps), delta)
    scores = -audited.canaries.detach().cpu().double().flatten().numpy()
    share = reachable(rate, steps)
    best = best_guesses(scores, inserted, delta=delta, confidence=confidence, share=share)
    return EpsilonAudit(
        target=target,
        delta=delta,
        charged=charged,
        noise_multiplier=sigma,
        sample_rate=rate,
        steps=steps,
        canaries=canaries,
        inserted=int(inserted.sum()),
        guesses=best.guesses,
        correct=best.correct,
        lower_bound=best.lower_bound,
        ceiling=best.ceiling,
        confidence=confidence,
        control=control,
        seconds=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class _OneRound:
    """The plan a `SiloPrivacy` budgets for: one round of local training and no released statistics."""

    rounds: int = 1

    def statistics_plan(self) -> tuple[tuple, int]:
        return (), 0


def silo_round(settings: DPSettings, seed: int) -> SiloPrivacy:
    """The silo's real privacy side under `settings`, its CSPRNG seeded so that the audit is reproducible."""
    ledger = PrivacyLedger(Budget(settings.epsilon, settings.delta))
    return SiloPrivacy(
        settings, method=_OneRound(), ledger=ledger, rng=SecureRandom.seeded(f"epsilon-audit-{seed}")
    )


def epsilon_audit(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epsilon: float,
    delta: float,
    canaries: int,
    seed: int,
    train: TrainConfig,
    control: bool = False,
    max_grad_norm: float = 1.0,
) -> EpsilonAudit:
    """Audit the silo's DP-SGD at target `epsilon` (σ picked by its accountant for one round of `train` on
    (x, y)); with `control`, the same run with the noise off."""
    settings = DPSettings(enabled=True, epsilon=epsilon, delta=delta, max_grad_norm=max_grad_norm)
    private: PrivateRound = silo_round(settings, seed)
    if control:
        private = NoiseOff(private)
    return audit_private(
        model,
        x,
        y,
        private,
        delta=delta,
        canaries=canaries,
        seed=seed,
        train=train,
        target=epsilon,
        control=control,
    )


def epsilon_grid(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epsilons: Sequence[float],
    delta: float,
    canaries: int,
    seed: int,
    train: TrainConfig,
) -> list[EpsilonAudit]:
    """One audit per ε of the grid, then the no-noise control at the largest."""
    runs = [
        epsilon_audit(model, x, y, epsilon=e, delta=delta, canaries=canaries, seed=seed, train=train)
        for e in epsilons
    ]
    control = epsilon_audit(
        model,
        x,
        y,
        epsilon=max(epsilons),
        delta=delta,
        canaries=canaries,
        seed=seed,
        train=train,
        control=True,
    )
    return [*runs, control]
