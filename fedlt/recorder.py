"""Per-round evaluation and the run folder a person reads: metrics.json, the accuracy table and the plots.

Shared by the simulator and the aggregator so both report the same way. metrics.json is rewritten atomically
after every round, so it is always whole, whatever happens to the process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from torch import nn

from fedlt.atomic import atomic_write_text
from fedlt.data.arrays import LabeledImages
from fedlt.metrics import GROUPS, ShotThresholds, accuracy_from_counts, evaluate
from fedlt.reports import accuracy_table, percent, plot_curves, plot_per_class

METRICS = "metrics.json"


class RunRecorder:
    def __init__(
        self,
        out: Path,
        *,
        title: str,
        test: LabeledImages,
        train_counts: Sequence[int] | None,
        thresholds: ShotThresholds,
        header: dict,
        rounds: Sequence[dict] = (),
    ) -> None:
        self.out = out
        self.title = title
        self.test = test
        self.thresholds = thresholds
        if train_counts is None:
            self.train_counts = None
            self.groups = {g: [] for g in GROUPS}
            rules = dict.fromkeys(GROUPS, "unknown: class training counts were not given")
        else:
            self.train_counts = np.asarray(train_counts, dtype=np.int64)
            self.groups = thresholds.groups(self.train_counts)
            rules = thresholds.rules()
        self.rules = rules
        self.header = {
            **header,
            "shot_groups": {g: {"rule": rule, "classes": self.groups[g]} for g, rule in rules.items()},
        }
        self.rounds = list(rounds)
        out.mkdir(parents=True, exist_ok=True)

    def evaluate(self, round_number: int, model: nn.Module, **facts: object) -> dict:
        """The round's entry: accuracies of `model` after `round_number`, plus any facts to keep with them."""
        return {"round": round_number, **evaluate(model, self.test, self.groups), **facts}

    def counted(self, round_number: int, correct: list[int], total: list[int], **facts: object) -> dict:
        """The round's entry from per-class counts summed at the silos (where only they hold the model)."""
        return {"round": round_number, **accuracy_from_counts(correct, total, self.groups), **facts}

    def append(self, entry: dict) -> None:
        self.rounds.append(entry)
        atomic_write_text(self.out / METRICS, json.dumps({**self.header, "rounds": self.rounds}, indent=1))

    def finish(self) -> str:
        """Write the final metrics and plots; return the accuracy table for the terminal."""
        final = self.rounds[-1]
        atomic_write_text(
            self.out / METRICS,
            json.dumps({**self.header, "rounds": self.rounds, "final": final}, indent=1),
        )
        classes = self.test.classes
        plot_curves(self.rounds, self.out / "accuracy.png", self.title)
        plot_per_class(final, classes, self.train_counts, self.groups, self.out / "per_class.png", self.title)
        return accuracy_table(final, classes, self.train_counts, self.rules)


def round_line(entry: dict, total: int) -> str:
    """One progress line; a round re-evaluated after a restart has no known duration."""
    seconds = entry.get("seconds")
    took = f"  ({seconds:.1f} s)" if seconds is not None else ""
    spent = f"  ε {entry['epsilon_spent']:.2f}" if "epsilon_spent" in entry else ""  # the most any silo spent
    return (
        f"round {entry['round']:>4}/{total}  acc {percent(entry['accuracy'])}  many {percent(entry['many'])}"
        f"  medium {percent(entry['medium'])}  few {percent(entry['few'])}{spent}{took}"
    )
