"""Per-round evaluation and the run folder a person reads: metrics.json, the accuracy table and the plots.

Shared by the simulator and the aggregator so both report the same way. metrics.json is rewritten atomically
after every round, so it is always whole, whatever happens to the process; each round then goes to the run's
telemetry (`fedlt.telemetry`: TensorBoard event files, MLflow), whose failures never stop a round.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedlt.atomic import atomic_write_text
from fedlt.data.arrays import LabeledData
from fedlt.device import CPU
from fedlt.metrics import GROUPS, ShotThresholds, accuracy_from_counts, evaluate
from fedlt.reports import accuracy_table, percent, plot_curves, plot_per_class

if TYPE_CHECKING:
    from fedlt.telemetry import Telemetry

METRICS = "metrics.json"


class RunRecorder:
    """`test` None: the run is evaluated elsewhere and only its per-class counts come here (`counted`), for
    a model of `classes`; `train_counts` may then arrive later (`know_train_counts`). `device`: where
    `evaluate` runs the model (`fedlt.device`). `telemetry`: where each appended round goes besides
    metrics.json, opened on the same `rounds` (closed by `finish` or `close`)."""

    def __init__(
        self,
        out: Path,
        *,
        title: str,
        test: LabeledData | None,
        train_counts: Sequence[int] | None,
        thresholds: ShotThresholds,
        header: dict,
        rounds: Sequence[dict] = (),
        classes: Sequence[str] = (),
        device: torch.device = CPU,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.out = out
        self.telemetry = telemetry
        self.device = device
        self.title = title
        self.test = test
        self.classes = tuple(test.classes) if test is not None else tuple(classes)
        self.thresholds = thresholds
        self.header = header
        self.know_train_counts(train_counts)
        self.rounds = list(rounds)
        out.mkdir(parents=True, exist_ok=True)

    def know_train_counts(self, train_counts: Sequence[int] | None) -> None:
        """The training records per class that the shot groups are drawn from (None: unknown, no groups)."""
        if train_counts is None:
            self.train_counts = None
            self.groups = {g: [] for g in GROUPS}
            rules = dict.fromkeys(GROUPS, "unknown: class training counts were not given")
        else:
            self.train_counts = np.asarray(train_counts, dtype=np.int64)
            self.groups = self.thresholds.groups(self.train_counts)
            rules = self.thresholds.rules()
        self.rules = rules
        self.header = {
            **self.header,
            "shot_groups": {g: {"rule": rule, "classes": self.groups[g]} for g, rule in rules.items()},
        }

    def evaluate(self, round_number: int, model: nn.Module, **facts: object) -> dict:
        """The round's entry: accuracies of `model` after `round_number`, plus any facts to keep with them."""
        return {"round": round_number, **evaluate(model, self.test, self.groups, device=self.device), **facts}

    def counted(self, round_number: int, correct: list[int], total: list[int], **facts: object) -> dict:
        """The round's entry from per-class counts summed at the silos (where only they hold the model)."""
        return {"round": round_number, **accuracy_from_counts(correct, total, self.groups), **facts}

    def append(self, entry: dict) -> None:
        self.rounds.append(entry)
        atomic_write_text(self.out / METRICS, json.dumps({**self.header, "rounds": self.rounds}, indent=1))
        if self.telemetry is not None:
            self.telemetry.record(entry, self.classes)

    def finish(self) -> str:
        """Write the final metrics and plots, close the telemetry; return the accuracy table for the
        terminal."""
        final = self.rounds[-1]
        atomic_write_text(
            self.out / METRICS,
            json.dumps({**self.header, "rounds": self.rounds, "final": final}, indent=1),
        )
        self.plot()
        self.close()
        return accuracy_table(final, self.classes, self.train_counts, self.rules)

    def close(self) -> None:
        """Flush and close the telemetry (once: later rounds reach metrics.json only)."""
        telemetry, self.telemetry = self.telemetry, None
        if telemetry is not None:
            telemetry.close()

    def plot(self) -> None:
        """Draw the accuracy curves and the last round's per-class accuracy (about 0.2 s of matplotlib's Agg
        canvas). The aggregator calls it after each recorded round, so the plots exist while a run goes on;
        each file is replaced whole, so a reader never meets half a PNG."""
        rounds = list(self.rounds)
        if not rounds:
            return
        self._replace("accuracy.png", lambda path: plot_curves(rounds, path, self.title))
        self._replace(
            "per_class.png",
            lambda path: plot_per_class(
                rounds[-1], self.classes, self.train_counts, self.groups, path, self.title
            ),
        )

    def _replace(self, name: str, draw: Callable[[Path], None]) -> None:
        part = self.out / f".{Path(name).stem}.part.png"  # savefig takes the format from the suffix
        draw(part)
        os.replace(part, self.out / name)


def round_line(entry: dict, total: int) -> str:
    """One progress line; a round re-evaluated after a restart has no known duration."""
    seconds = entry.get("seconds")
    took = f"  ({seconds:.1f} s)" if seconds is not None else ""
    spent = f"  ε {entry['epsilon_spent']:.2f}" if "epsilon_spent" in entry else ""  # the most any silo spent
    return (
        f"round {entry['round']:>4}/{total}  acc {percent(entry['accuracy'])}  many {percent(entry['many'])}"
        f"  medium {percent(entry['medium'])}  few {percent(entry['few'])}{spent}{took}"
    )
