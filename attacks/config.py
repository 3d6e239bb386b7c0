"""The audit grid as a TOML file (`configs/audit.toml`), validated at load with every problem named.

A grid is one federation (an embedded dataset, split long-tailed over silos, seeded), a short training run
that gives the model every attack works against, the sharing modes to compare and the attacks to run on
each, and the leakage thresholds that make the audit fail. A mode with `audited = true` is one the
consortium relies on: crossing a threshold there fails the audit (exit code 1); the others (plaintext) are
shown for contrast, so the report says what the protections remove.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedlt.aggregation import layer_names
from fedlt.config import parse_section, read_toml, setting
from fedlt.data.federation import DataConfig
from fedlt.errors import ConfigError

ATTACKS = ("analytic", "moments", "decoder", "gradinv", "presence", "membership", "protocol", "epsilon")


@dataclass(frozen=True)
class Training:
    rounds: int = setting(4, ge=1, le=200, doc="FedAvg rounds that train the model the attacks face")
    local_epochs: int = setting(1, ge=1)
    lr: float = setting(0.05, gt=0.0)
    momentum: float = setting(0.9, ge=0.0, le=1.0)


@dataclass(frozen=True)
class Mode:
    name: str = setting("", doc="the row's name in the report")
    privacy: str = setting("plaintext", choices=layer_names)
    k_min: int = setting(2, ge=0, doc="secagg tail guard: per-class rows of fewer holders are zeroed; <2 off")
    min_records: int = setting(
        0,
        ge=0,
        doc="statistics that invert (moments, per-class gradients) without [dp]: 0 the silos refuse to "
        "release them (their default), 1 released, >= 2 released for classes this many records hold",
    )
    epsilon: float = setting(0.0, ge=0.0, doc="> 0: every silo runs under [dp] with this budget")
    audited: bool = setting(True, doc="a crossed threshold in this mode fails the audit")


@dataclass(frozen=True)
class EpsilonSettings:
    """The one-run ε audit of a silo's DP-SGD (`attacks.epsilon`): a training run per ε, then the control."""

    epsilons: tuple[float, ...] = setting((1.0, 4.0, 8.0), doc="the ε each audited run is planned for")
    canaries: int = setting(
        100_000,
        ge=20_000,
        doc="gradient canaries, each put in with probability 1/2; fewer leave the control's best guess count "
        "within chance of the canaries it can see (at one epoch, 20,000 keep it 4.8 standard deviations off)",
    )
    epochs: int = setting(3, ge=1, doc="local epochs of the audited run")
    batch_size: int = setting(64, ge=1)
    lr: float = setting(0.05, gt=0.0)


@dataclass(frozen=True)
class Thresholds:
    ssim_over_random: float = setting(
        0.2, doc="median SSIM above the better of the random and prior baselines"
    )
    feature_error: float = setting(0.05, ge=0.0, doc="relative error of a recovered feature below this")
    presence_auc: float = setting(0.65, ge=0.5, le=1.0, doc="class-presence ROC-AUC above this")
    membership_tpr: float = setting(0.01, ge=0.0, le=1.0, doc="membership TPR at 0.1% FPR above this")


@dataclass(frozen=True)
class AuditConfig:
    seed: int = setting(0, ge=0)
    data: DataConfig = field(default_factory=lambda: DataConfig(silos=4))
    training: Training = field(default_factory=Training)
    attacks: tuple[str, ...] = ATTACKS
    modes: tuple[Mode, ...] = ()
    thresholds: Thresholds = field(default_factory=Thresholds)
    epsilon: EpsilonSettings = field(default_factory=EpsilonSettings)


def load_audit_config(path: str | Path) -> AuditConfig:
    """The grid in `path`, or a ConfigError listing every problem."""
    tree = dict(read_toml(path))
    problems: list[str] = []
    modes = tree.pop("mode", [])
    attacks = tree.pop("attacks", list(ATTACKS))
    config = parse_section(AuditConfig, tree, "", problems)
    parsed = []
    if not isinstance(modes, list) or not modes:
        problems.append("mode: at least one [[mode]] table (the sharing modes to compare)")
        modes = []
    for i, table in enumerate(modes):
        mode = parse_section(Mode, table, f"mode[{i}]", problems)
        problems += _mode_problems(mode, f"mode[{i}]")
        parsed.append(mode)
    names = [m.name for m in parsed]
    if len(set(names)) != len(names):
        problems.append(f"mode: names must differ, got {names}")
    problems += _epsilon_problems(config.epsilon)
    if not isinstance(attacks, list) or not all(a in ATTACKS for a in attacks):
        problems.append(f"attacks: a list drawn from {', '.join(ATTACKS)}, got {attacks!r}")
        attacks = list(ATTACKS)
    if problems:
        raise ConfigError(path, problems)
    return AuditConfig(
        seed=config.seed,
        data=config.data,
        training=config.training,
        attacks=tuple(attacks),
        modes=tuple(parsed),
        thresholds=config.thresholds,
        epsilon=config.epsilon,
    )


def _epsilon_problems(settings: EpsilonSettings) -> list[str]:
    """ε settings the audit could not use: no ε, or too few canaries to show even the smallest (a run that
    cannot fail, beside a control that cannot reach a ceiling worth the name)."""
    from attacks.one_run import ceiling
    from fedlt.dp import DPSettings

    if not settings.epsilons or any(e <= 0 for e in settings.epsilons):
        return [f"epsilon.epsilons: one or more ε above 0, got {list(settings.epsilons)}"]
    delta = DPSettings().delta
    most = ceiling(settings.canaries, delta=delta)
    if most < min(settings.epsilons):
        return [
            f"epsilon.canaries: {settings.canaries} canaries can show at most ε = {most:.2f} at "
            f"δ = {delta:g}, below the smallest ε audited ({min(settings.epsilons):g}); 100000 show up "
            f"to {ceiling(100_000, delta=delta):.1f}"
        ]
    return []


def _mode_problems(mode: Mode, where: str) -> list[str]:
    problems = []
    if not mode.name:
        problems.append(f"{where}.name: every mode needs a name")
    if mode.epsilon > 0 and mode.privacy == "plaintext":
        problems.append(f"{where}: DP noise on released sums needs a sum layer (secagg or ckks)")
    return problems
