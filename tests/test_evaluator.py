"""The aggregator's evaluation beside the commit: overlapped with it, recorded only once it is durable."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from aggregator.evaluation import Evaluator


class Recorder:
    def __init__(self) -> None:
        self.rounds: list[dict] = []

    def evaluate(self, round_number: int, model: object, **facts: object) -> dict:
        return {"round": round_number, "accuracy": 0.5, "many": 0.5, "medium": None, "few": 0.5, **facts}

    def append(self, entry: dict) -> None:
        self.rounds.append(entry)


class Store:
    def __init__(self) -> None:
        self.metrics: dict[int, dict] = {}

    def save_metrics(self, round_number: int, entry: dict) -> None:
        self.metrics[round_number] = entry


class WaitingMethod:
    """Evaluates only once the commit has begun: evaluating after the commit would never get there."""

    def __init__(self, committing: threading.Event) -> None:
        self.committing = committing

    def eval_model(self, state: object) -> object:
        assert self.committing.wait(timeout=120), "evaluation did not run beside the commit"
        return object()


def _evaluator(method: object, *, background: bool = False) -> tuple[Evaluator, Store, list[str]]:
    store, lines = Store(), []
    evaluator = Evaluator(
        recorder=Recorder(),
        method=method,
        store=store,
        background=background,
        echo=lines.append,
        total_rounds=lambda: 5,
    )
    return evaluator, store, lines


STATE = SimpleNamespace(round=3, digest=lambda: "d" * 64)


def test_evaluation_runs_beside_the_commit_and_is_recorded_only_after_it():
    committing = threading.Event()
    evaluator, store, lines = _evaluator(WaitingMethod(committing))
    begun = evaluator.begin(STATE)
    assert begun is not None
    committing.set()  # the commit's disk work: evaluation proceeds meanwhile
    begun.result(timeout=120)
    assert store.metrics == {}
    assert lines == []
    evaluator.committed(STATE, ["silo-0", "silo-1"], 2.5, begun)
    evaluator.shutdown()
    assert store.metrics[3]["contributors"] == ["silo-0", "silo-1"]
    assert store.metrics[3]["seconds"] == 2.5
    assert store.metrics[3]["state_digest"] == "d" * 64
    assert len(lines) == 1
    assert lines[0].startswith("round    3/5")


def test_a_commit_that_never_happens_leaves_no_metrics():
    committing = threading.Event()
    committing.set()
    evaluator, store, lines = _evaluator(WaitingMethod(committing))
    evaluator.begin(STATE)
    evaluator.shutdown()  # the commit failed: `committed` is never called
    assert store.metrics == {}
    assert lines == []


def test_background_evaluation_does_not_start_before_the_commit():
    committing = threading.Event()
    committing.set()
    evaluator, store, _ = _evaluator(WaitingMethod(committing), background=True)
    assert evaluator.begin(STATE) is None
    evaluator.committed(STATE, ["silo-0"], 1.0)
    evaluator.shutdown()
    assert store.metrics[3]["contributors"] == ["silo-0"]
