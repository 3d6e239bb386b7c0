"""The one-run bound of Steinke, Nasr and Jagielski ("Privacy Auditing with One (1) Training Run", NeurIPS
2023): what guesses about m canaries, each put in with probability 1/2, prove about the ε of the run that
saw them. Statistics only, no training: `attacks.epsilon` runs the silo's DP-SGD with the canaries, and the
audit's configuration checks with `ceiling` that a grid's canaries can show its ε at all.

Score of canary j: its coordinate's descent −θ_T[j] (it starts at 0). The auditor guesses "included" for the
k highest scores and abstains on the rest. With r = k guesses of which v are right, the paper's main theorem
for (ε, δ)-DP says P[v or more right] ≤ f(v) + 2mδ·max_{i=1..m} (f(v − i) − f(v)) / i, where
f(v) = P[Binomial(r, e^ε / (1 + e^ε)) ≥ v]; the lower bound is the largest ε that this rejects at confidence
1 − β, with β split (Bonferroni) over the few k tried. Unlike the paper, no "excluded" guesses for the
lowest scores: a canary that is in but never sampled scores like one left out, so without noise those
guesses go wrong and the control could not reach the bound's ceiling.

The ceiling: with every guess right the bound still stops near ln(β·r / (m·δ)) whatever m is, because the δ
term stays near mδ·e^ε / r (i near r·e^-ε). With 4 values of k at 95% and δ = 1e-5 it is 5.8–6.0 for m
from 2·10^4 to 10^6: a lower bound can never reach the grid's ε = 8 at that δ, so the ε = 8 row cannot
fail. The audit reports the ceiling beside each bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import expit
from scipy.stats import binom

CONFIDENCE = 0.95
# how many of the highest scores are guessed in, as fractions of the canaries expected to be in and sampled
# at least once (`reachable`): the first stays below it, so that with the noise off every guess can be right
GUESS_FRACTIONS = (0.95, 0.2, 0.06, 0.02)
THREE_EPOCHS = 0.475  # what `reachable` gives three epochs, for a ceiling known before any run
_SEARCH_STEPS = 40  # halvings of the bracket [b, 2b] that doubling from ε = 1 finds


def p_value(*, guesses: int, correct: int, canaries: int, epsilon: float, delta: float) -> float:
    """The main theorem's bound on P[at least `correct` of `guesses` right] for an (ε, δ)-DP mechanism over
    `canaries` randomised inputs."""
    _check_counts(guesses, correct, canaries)
    if correct == 0:
        return 1.0
    q = float(expit(epsilon))  # e^ε / (1 + e^ε): the accuracy of ε-DP randomised response
    tail = float(binom.sf(correct - 1, guesses, q))  # f(v)
    return min(1.0, tail + 2 * canaries * delta * _alpha(guesses, correct, q))


def _alpha(guesses: int, correct: int, q: float) -> float:
    """max over i >= 1 of (f(v − i) − f(v)) / i = P[v − i <= Binomial(r, q) < v] / i, summed exactly over
    the binomial's mass (its mean ± 40 standard deviations) and bounded above beyond it by adding the mass
    left below (under 1e-300): summing those terms one by one took seconds a bound on 10^6 guesses. For
    i > v the term is (1 − f(v)) / i, under its value at i = v."""
    spread = 40 * math.sqrt(guesses * q * (1 - q)) + 1
    low = min(max(0, math.floor(guesses * q - spread)), correct - 1)
    below = binom.pmf(np.arange(correct - 1, low - 1, -1), guesses, q)  # P[Bin = v − i], i = 1..v − low
    partial = np.cumsum(below)
    inside = float(np.max(partial / np.arange(1, len(partial) + 1)))
    left = float(binom.cdf(low - 1, guesses, q)) if low > 0 else 0.0
    return max(inside, (float(partial[-1]) + left) / (len(partial) + 1)) if left > 0 else inside


def lower_bound(*, guesses: int, correct: int, canaries: int, delta: float, beta: float) -> float:
    """The largest ε (found by bisection) whose (ε, δ)-DP the outcome rejects at level `beta`; 0 if none.

    Any ε with p_value < beta is rejected, and so is every smaller ε (a mechanism that is (ε', δ)-DP is
    (ε, δ)-DP for ε > ε'), so the bound is sound even where the p-value is not monotone in ε."""
    if not 0 < beta < 1:
        raise ValueError(f"β is in (0, 1), got {beta}")

    def rejected(eps: float) -> bool:
        return p_value(guesses=guesses, correct=correct, canaries=canaries, epsilon=eps, delta=delta) < beta

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2 * high
    for _ in range(_SEARCH_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return low


def _check_counts(guesses: int, correct: int, canaries: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")


def reachable(sample_rate: float, steps: int) -> float:
    """The share of canaries expected in and sampled at least once: half are in, each sampled at a step with
    probability q. From the run's public parameters only, never from which canaries went in."""
    return 0.5 * (1.0 - (1.0 - sample_rate) ** steps)


def guess_counts(canaries: int, share: float = THREE_EPOCHS) -> list[int]:
    """How many of the highest scores are guessed in, one audit each: `GUESS_FRACTIONS` of the `share` of
    `canaries` that can move (`reachable`)."""
    return sorted({max(1, round(f * share * canaries)) for f in GUESS_FRACTIONS}, reverse=True)


def ceiling(
    canaries: int, *, delta: float, confidence: float = CONFIDENCE, share: float = THREE_EPOCHS
) -> float:
    """The most an audit of `canaries` can show: its bound had every guess been right."""
    counts = guess_counts(canaries, share)
    beta = (1 - confidence) / len(counts)
    return max(lower_bound(guesses=k, correct=k, canaries=canaries, delta=delta, beta=beta) for k in counts)


@dataclass(frozen=True)
class Guesses:
    """The best of the guess counts tried: how many guesses, how many right, and the ε it rejects."""

    guesses: int
    correct: int
    lower_bound: float
    ceiling: float  # the best bound of any guess count had every guess been right (`ceiling`)


def best_guesses(
    scores: np.ndarray, inserted: np.ndarray, *, delta: float, confidence: float, share: float = THREE_EPOCHS
) -> Guesses:
    """Guess "in" for the highest `scores` against the truth `inserted`, at every count of `guess_counts`
    with β split evenly over them (Bonferroni); the count with the highest bound."""
    canaries = len(scores)
    counts = guess_counts(canaries, share)
    beta = (1 - confidence) / len(counts)
    order = np.argsort(-scores, kind="stable")
    found = []
    for k in counts:
        right = int(inserted[order[:k]].sum())
        found.append(
            (lower_bound(guesses=k, correct=right, canaries=canaries, delta=delta, beta=beta), k, right)
        )
    bound, k, right = max(found)
    return Guesses(k, right, bound, ceiling(canaries, delta=delta, confidence=confidence, share=share))
