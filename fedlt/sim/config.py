"""The simulator's configuration: a TOML file, overridden by command-line flags, validated as a whole."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fedlt.aggregation import layer_names
from fedlt.config import as_table, parse_section, read_toml, render_toml, setting
from fedlt.data.federation import DataConfig
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.methods import TrainConfig
from fedlt.methods.choice import MethodChoice
from fedlt.metrics import ShotThresholds
from fedlt.models import ENTRY_FORM, MODELS, ModelOptions
from fedlt.plan import ModelSection
from fedlt.selection import SelectionConfig
from fedlt.sim.backend import BackendConfig


@dataclass(frozen=True)
class ModelChoice:
    """`auto` (by image size), a built-in model, or one named by entry point with its factory's `options`."""

    name: str = setting("auto", doc=f"auto picks by image size; {', '.join(MODELS)}; or {ENTRY_FORM}")
    options: ModelOptions = field(default_factory=ModelOptions)

    def problems(self) -> list[str]:
        if self.name == "auto":
            return ["model.options: auto picks a built-in model, which takes none"] if self.options else []
        return ModelSection(name=self.name, options=self.options).problems()

    def to_table(self) -> dict[str, Any]:
        """Without options, as before entry points: a run's fingerprint, and so its checkpoint, stay valid."""
        return {"name": self.name, **({"options": self.options.to_table()} if self.options else {})}


@dataclass(frozen=True)
class SimConfig:
    seed: int = setting(0, ge=0)
    rounds: int = setting(20, ge=1, le=100_000)
    privacy: str = setting("plaintext", choices=layer_names)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelChoice = field(default_factory=ModelChoice)
    train: TrainConfig = field(default_factory=TrainConfig)
    method: MethodChoice = field(default_factory=MethodChoice)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    metrics: ShotThresholds = field(default_factory=ShotThresholds)
    dp: DPSettings = field(default_factory=DPSettings)
    sim: BackendConfig = field(default_factory=BackendConfig)

    def fingerprint(self) -> str:
        """Identifies the run a checkpoint belongs to; `rounds` is left out so a run can be extended, and
        `[sim]` so that it can resume on another backend."""
        table = {k: v for k, v in as_table(replace(self, rounds=1)).items() if k != "sim"}
        return hashlib.sha256(render_toml(table).encode()).hexdigest()


# flag name -> (section, key) in the TOML tree
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "seed": ("seed",),
    "rounds": ("rounds",),
    "privacy": ("privacy",),
    "dataset": ("data", "dataset"),
    "imbalance": ("data", "imbalance"),
    "alpha": ("data", "alpha"),
    "silos": ("data", "silos"),
    "model": ("model", "name"),
    "local_epochs": ("train", "local_epochs"),
    "device": ("train", "device"),
    "method": ("method", "name"),
    "per_round": ("selection", "per_round"),
    "selection": ("selection", "strategy"),
    "epsilon": ("dp", "epsilon"),
    "backend": ("sim", "backend"),
    "address": ("sim", "address"),
    "threads": ("sim", "threads"),
    "workers": ("sim", "workers"),
}
# flags that also switch a section on
FLAG_ENABLES: dict[str, tuple[str, ...]] = {"epsilon": ("dp", "enabled")}


def load_sim_config(
    path: str | None,
    flags: Mapping[str, Any],
    method: Mapping[str, Any] | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> SimConfig:
    """The file's settings with `method` (a whole `[method]` table), then `tables` (settings merged into
    their sections) and then every flag that was given laid over them; all problems raised together."""
    tree: dict[str, Any] = read_toml(path) if path else {}
    if method is not None:
        tree["method"] = dict(method)
    for section, values in (tables or {}).items():
        node = tree.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(path or "settings", [f"{section}: expected a table"])
        node.update(values)
    for flag, value in flags.items():
        if value is None:
            continue
        for keys, set_to in ((FLAG_KEYS[flag], value), (FLAG_ENABLES.get(flag), True)):
            if keys is None:
                continue
            *sections, key = keys
            node = tree
            for section in sections:
                node = node.setdefault(section, {})
                if not isinstance(node, dict):
                    raise ConfigError(path or "flags", [f"{section}: expected a table"])
            node[key] = set_to
    problems: list[str] = []
    config = parse_section(SimConfig, tree, "", problems)
    problems += config.model.problems() + config.selection.problems()
    problems += config.dp.problems(discloses=config.selection.discloses)
    if config.sim.backend == "ray" and config.train.device not in ("cpu", "auto"):
        problems.append(
            f"train.device: {config.train.device!r} with sim.backend = 'ray': Ray's tasks train on their "
            "nodes' CPUs (a task sees no GPU unless it asks for one); use cpu or auto"
        )
    if config.selection.per_round > config.data.silos:
        problems.append(
            f"selection.per_round: {config.selection.per_round} silos a round, "
            f"but data.silos is only {config.data.silos}"
        )
    if problems:
        raise ConfigError(path or "command-line flags", problems)
    return config
