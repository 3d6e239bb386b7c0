"""The `[dp]` section every party reads alike (the simulator's config and the consortium's signed plan), and
the one door to the implementation of it, which is injected, as privacy layers are.

`fedlt` names no `privacy` module (imports point one way): `silo_privacy` finds the implementation through
the `fedlt.dp` entry point (pyproject.toml) only when a run asks for differential privacy.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fedlt.config import setting

DP_GROUP = "fedlt.dp"


@dataclass(frozen=True)
class DPSettings:
    """Sample-level DP for every silo's records: DP-SGD in local training, noise on every released statistic,
    per-class counts noised once per run, and one (ε, δ) ledger per silo that refuses work past its budget."""

    enabled: bool = setting(False, doc="DP-SGD in local training, with a privacy ledger per silo")
    epsilon: float = setting(
        8.0, gt=0.0, doc="the ε each silo spends over the planned rounds (its budget in the simulator)"
    )
    delta: float = setting(1e-5, gt=0.0, le=0.1, doc="δ; keep it well below 1 / (records of a silo)")
    noise_multiplier: float = setting(
        0.0, ge=0.0, doc="DP-SGD σ; 0: each silo picks the smallest σ that keeps the plan within ε"
    )
    max_grad_norm: float = setting(1.0, gt=0.0, doc="C: every record's gradient is clipped to this L2 norm")
    count_noise: float = setting(
        10.0,
        gt=0.0,
        doc="std of the Gaussian noise on a silo's per-class record counts, released once per run",
    )
    feature_norm: float = setting(
        5.0, gt=0.0, doc="every record's feature vector is clipped to this L2 norm before any statistic of it"
    )
    statistics_noise: float = setting(
        0.0,
        ge=0.0,
        doc="noise on released statistics, its std at the sum over a field's per-record sensitivity; "
        "0: the smallest that keeps the plan's statistics releases within half of ε",
    )

    def problems(self, *, discloses: bool) -> list[str]:
        """What the field-by-field checks cannot see: a plan that also discloses per-silo statistics."""
        if self.enabled and discloses:
            return [
                "selection.strategy: mfsc discloses each silo's class means outside any sum, which [dp] does "
                "not cover; under [dp] pick silos at random"
            ]
        return []


def silo_privacy(settings: DPSettings, *, method: Any, ledger: Path | None, budget: Any = None) -> Any:
    """A silo's `privacy.dp.SiloPrivacy` for `method`'s plan under `settings`; its ledger lives at `ledger`
    (in memory if None) with `budget` (a `privacy.dp.Budget`; the settings' ε and δ if None)."""
    (implementation,) = entry_points(group=DP_GROUP, name="silo_privacy")
    return implementation.load().open(settings, method=method, ledger=ledger, budget=budget)
