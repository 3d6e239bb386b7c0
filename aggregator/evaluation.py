"""Evaluating committed states on the operator's own evaluation set, and printing one line per round.

Evaluation is reporting, not part of a round: it runs on a thread of its own, with a method instance of its
own, beside the round's commit (by default) or beside the next round (`evaluation.background`). Where silos
evaluate on their own held-out data, only the sums of their per-class counts arrive (`counted`), and there is
no method here. Without either a round is only announced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures

from aggregator.store import Store
from fedlt.methods import GlobalState, Method
from fedlt.recorder import RunRecorder, round_line

log = logging.getLogger("aggregator")


class Evaluator:
    def __init__(
        self,
        *,
        recorder: RunRecorder | None,
        method: Method | None,
        store: Store,
        background: bool,
        echo: Callable[[str], None],
        total_rounds: Callable[[], int],
    ) -> None:
        self.recorder, self.method, self.store = recorder, method, store
        self.background, self.echo, self.total_rounds = background, echo, total_rounds
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluation")

    def catch_up(self, state: GlobalState) -> None:
        """After a restart: evaluate the last committed state if the history stops short of it."""
        if self.method is not None and state.round > 0 and state.round > len(self.recorder.rounds):
            self._pool.submit(self._report, state, None, None)

    def begin(self, state: GlobalState) -> futures.Future | None:
        """Start evaluating a state about to be committed, where evaluation sits on the round's critical path:
        the commit waits on the disk, evaluation on the processor, so they overlap. Its result is recorded
        only by `committed`, once the state is durable."""
        if self.method is None or self.background:
            return None
        return self._pool.submit(self._evaluate, state)

    def committed(
        self,
        state: GlobalState,
        contributors: list[str],
        seconds: float,
        begun: futures.Future | None = None,
    ) -> None:
        """`begun`: what `begin` started for this state, waited for and recorded here; without it (background
        evaluation) the state is evaluated beside the next round."""
        if self.method is None:
            self.echo(f"round {state.round:>4}/{self.total_rounds()} committed, {len(contributors)} silos")
        elif begun is not None:
            self._recorded(begun.result(), contributors, seconds)
        else:
            self._pool.submit(self._report, state, contributors, seconds)

    def announce(self, round_number: int, contributors: list[str], seconds: float) -> None:
        """A round whose evaluation only silos can compute: announced now, its accuracy when they report."""
        self.echo(
            f"round {round_number:>4}/{self.total_rounds()} committed, {len(contributors)} silos "
            f"({seconds:.1f} s)"
        )

    def counted(
        self,
        round_number: int,
        correct: Sequence[int],
        total: Sequence[int],
        contributors: list[str],
        seconds: float | None,
        *,
        train_counts: Sequence[int] | None = None,
    ) -> None:
        """The silos' summed evaluation counts of a committed round, once per round (a state evaluated again,
        in the round after a run's rounds grew, is recorded as first summed). `train_counts`: the summed
        training records per class the shot groups come from, kept in the entry so a restart has them."""
        if self.recorder is None or self.has(round_number):
            return
        facts: dict[str, object] = {"contributors": contributors, "seconds": seconds}
        if train_counts is not None:
            self.recorder.know_train_counts(train_counts)
            facts["train_counts"] = list(train_counts)
        self._record(self.recorder.counted(round_number, list(correct), list(total), **facts), contributors)

    def has(self, round_number: int) -> bool:
        """Whether the metrics of `round_number` are recorded."""
        rounds = self.recorder.rounds if self.recorder is not None else []
        return any(entry["round"] == round_number for entry in rounds)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _report(self, state: GlobalState, contributors: list[str] | None, seconds: float | None) -> None:
        self._recorded(self._evaluate(state), contributors, seconds)

    def _evaluate(self, state: GlobalState) -> dict | None:
        try:
            return self.recorder.evaluate(
                state.round, self.method.eval_model(state), state_digest=state.digest()
            )
        except Exception:
            log.exception("evaluating round %d failed; training goes on", state.round)
            return None

    def _recorded(self, entry: dict | None, contributors: list[str] | None, seconds: float | None) -> None:
        if entry is not None:
            self._record({**entry, "contributors": contributors, "seconds": seconds}, contributors)

    def _record(self, entry: dict, contributors: list[str] | None) -> None:
        self.store.save_metrics(entry["round"], entry)
        self.recorder.append(entry)
        try:
            self._pool.submit(self._plot)  # on the evaluation thread, off the round's path
        except RuntimeError:  # shut down: the run is over, and the aggregator draws them once more
            log.debug("round %d recorded after the evaluation thread stopped", entry["round"])
        silos = f"  [{len(contributors)} silos]" if contributors else ""
        self.echo(round_line(entry, self.total_rounds()) + silos)

    def _plot(self) -> None:
        try:
            self.recorder.plot()
        except Exception:
            log.exception("drawing the plots in %s failed; training goes on", self.recorder.out)
