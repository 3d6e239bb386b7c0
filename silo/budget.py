"""`python -m silo budget --config silo.toml`: this silo's privacy ledger — budget, spending, every entry.

The ledger is the silo's one, in its state directory, whatever study spends from it (`SiloConfig.shared_dir`).
"""

from __future__ import annotations

from pathlib import Path

from privacy.dp import Budget, PrivacyLedger
from silo.config import SiloConfig

PRIVACY_LEDGER = "privacy-ledger.json"


def ledger_path(config: SiloConfig) -> Path:
    return config.shared_dir() / PRIVACY_LEDGER


def open_ledger(config: SiloConfig) -> PrivacyLedger:
    return PrivacyLedger(Budget(config.dp.epsilon, config.dp.delta), ledger_path(config))


def show_budget(config: SiloConfig) -> int:
    """Only reads (the agent replaces the ledger atomically): it needs no lock and runs beside the agent."""
    path = ledger_path(config)
    if not path.exists():
        print(
            f"no private work yet ({path} does not exist); "
            f"budget ε = {config.dp.epsilon:g} at δ = {config.dp.delta:g}"
        )
        return 0
    print(open_ledger(config).describe())
    return 0
