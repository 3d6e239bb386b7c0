"""Typed errors for user mistakes, so the CLIs print one clear message instead of a traceback."""

from __future__ import annotations

from pathlib import Path


class FedltError(Exception):
    """Base of every error caused by user input (data, configuration, a refused request)."""


class DataError(FedltError):
    """A data file or array is missing, unreadable or inconsistent; the message names the file."""

    def __init__(self, source: str | Path, reason: str) -> None:
        self.source = str(source)
        self.reason = reason
        super().__init__(f"{self.source}: {reason}")


class ConfigError(FedltError):
    """A configuration is invalid; carries every problem found, not just the first."""

    def __init__(self, source: str | Path, problems: list[str]) -> None:
        self.source = str(source)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration in {self.source}:\n{lines}")


class ContributionError(FedltError):
    """A contribution does not match the round's schema (names, shapes, non-finite values)."""
