"""Per-round metrics where operators already look: TensorBoard event files, an MLflow tracking server, and
Prometheus (`fedlt.telemetry.prometheus`, which is scraped rather than written to).

`RunRecorder` (`fedlt.recorder`) hands each round's entry, once metrics.json holds it, to a `Telemetry`,
which turns it into scalars under conventional tags (`scalars`) and gives them to each sink. A sink that
fails is logged and the round goes on: metrics.json stays the record, the sinks are views of it.
"""

from __future__ import annotations

import collections
import functools
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from fedlt.telemetry.to_mlflow import MlflowSink, MlflowTarget

log = logging.getLogger("fedlt.telemetry")

TENSORBOARD = "tensorboard"  # the event files' folder, in a run folder or an aggregator's data_dir
GROUP_TAGS = {"accuracy": "overall", "many": "many", "medium": "medium", "few": "few"}
# entry keys whose number is kept as is, and their tags
NUMBERS = {
    "seconds": "round/seconds",
    "train_seconds": "round/train_seconds",
    "epsilon_spent": "privacy/epsilon_spent",  # the simulator's: the most any silo has spent
    "clipped_values": "round/clipped_values",  # values beyond their field's bound, clipped before the sum
    "coverage_error": "selection/coverage_error",
}
# entry keys holding silo lists, counted: the simulator's silos picked for the round (selection.per_round)
COUNTED = {"participants": "silos/participants"}

Scalars = Mapping[str, float]


class Sink(Protocol):
    """Where a round's scalars go; `write` is called once per recorded round, in order of recording."""

    def write(self, step: int, values: Scalars) -> None: ...

    def close(self) -> None: ...


def tag_part(name: str) -> str:
    """`name` as one level of a tag: MLflow takes letters, digits, `_ - . /` and spaces in a metric's name
    but no level that is only dots, and a `/` would open another level in TensorBoard, so anything else
    becomes `_`."""
    part = re.sub(r"[^\w.\- ]", "_", name).strip()
    return part if part.strip(".") else "_" * max(len(part), 1)


def class_tags(classes: Sequence[str]) -> list[str]:
    """`accuracy/class/<name>` for each class, in order; two names that read the same once cleaned keep
    apart by their index."""
    parts = [tag_part(c) for c in classes]
    clash = {p for p, n in collections.Counter(parts).items() if n > 1}
    return [f"accuracy/class/{p}" + (f"_{k}" if p in clash else "") for k, p in enumerate(parts)]


def scalars(entry: Mapping, classes: Sequence[str]) -> dict[str, float]:
    """The entry's numbers under their tags (`accuracy/overall`, `accuracy/few`, `accuracy/class/<name>`,
    `round/seconds`, `silos/participants`, ...). A value the entry lacks or holds as None (a shot group
    without classes, a class without test records, a round re-evaluated after a restart, whose duration is
    unknown) is left out: missing is not zero."""
    found: dict[str, float] = {}
    for key, tag in {**GROUP_TAGS, **NUMBERS}.items():
        value = entry.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[f"accuracy/{tag}" if key in GROUP_TAGS else tag] = float(value)
    for key, tag in COUNTED.items():
        if isinstance(entry.get(key), list):
            found[tag] = float(len(entry[key]))
    per_class = entry.get("per_class") or []
    for tag, value in zip(class_tags(classes), per_class, strict=False):
        if value is not None:
            found[tag] = float(value)
    return found


Extra = Callable[[int], Scalars]
# a round recorded before this start: its step, and its scalars, made only if a sink needs them again
Past = tuple[int, Callable[[], Scalars]]


def round_values(entry: Mapping, classes: Sequence[str], extra: Extra | None) -> dict[str, float]:
    """`scalars` of the entry and the `extra` ones for its round (left out, and logged, if they fail)."""
    values = scalars(entry, classes)
    if extra is not None:
        try:
            values.update(extra(entry["round"]))
        except Exception:
            log.exception("round %d: its facts besides the accuracy could not be had", entry["round"])
    return values


class Telemetry:
    """The sinks of one run. `extra`: more scalars for a round, from what the caller knows when it is
    recorded (the aggregator: the silos the round invited and counted, each silo's reported ε, the state's
    size).

    Rounds may be recorded from more than one thread (the aggregator's evaluation thread, and the service's
    when silos report their evaluation counts): they reach the sinks one at a time."""

    def __init__(self, sinks: Sequence[Sink], *, extra: Extra | None = None) -> None:
        self.sinks = list(sinks)
        self._extra = extra
        self._lock = threading.Lock()

    def record(self, entry: Mapping, classes: Sequence[str]) -> None:
        if not self.sinks:
            return
        values = round_values(entry, classes, self._extra)
        with self._lock:
            for sink in self.sinks:
                try:
                    sink.write(entry["round"], values)
                except Exception:
                    log.exception("round %d: writing to %s failed; the run goes on", entry["round"], sink)

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception:
                    log.exception("closing %s failed", sink)


def open_telemetry(
    folder: Path | None,
    *,
    history: Sequence[Mapping],
    classes: Sequence[str],
    mlflow: MlflowTarget | None = None,
    extra: Extra | None = None,
) -> Telemetry:
    """TensorBoard event files in `folder` (None: none) and, with a target, an MLflow run. `history`: the
    entries the run recorded before this start, of which each sink writes those it lacks (all of them to a
    new folder or a new MLflow run), with their `extra` scalars as they are at this start."""
    past: list[Past] = [(e["round"], functools.partial(round_values, e, classes, extra)) for e in history]
    sinks: list[Sink] = []
    if folder is not None:
        from fedlt.telemetry.tensorboard import TensorBoardSink  # imports tensorboard: only when used

        sinks.append(TensorBoardSink(folder, history=past))
    if mlflow is not None:
        sinks.append(MlflowSink(mlflow, history=past))
    return Telemetry(sinks, extra=extra)


__all__ = [
    "TENSORBOARD",
    "MlflowTarget",
    "Past",
    "Sink",
    "Telemetry",
    "class_tags",
    "open_telemetry",
    "scalars",
    "tag_part",
]
