"""The end of a round: from its released contribution sum to the committed state and the metrics recorded.

The server step runs here on the method's part of the sum (`Sums`, sealed by the layer). Where the layer
lets only silos read the contribution sum (ckks), the silos run the server step themselves and report the
sealed state, its digest and what the next round needs (`held_state`); the round commits only if every silo
the sum counted reported the same state, and their evaluation counts go through one more sum of the layer
(`evaluation_sum`), whose total a silo reports back. With held-out evaluation the summed per-class counts
are stripped from the sum before the server step and recorded, once the round commits, as the metrics of
the state the round started from; the evaluation-only round after the last commits no state (an audit record
instead) and only records them. What has been committed and evaluated also says whether the run needs another
round (`round_due`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from aggregator.config import ConsortiumConfig
from aggregator.evaluation import Evaluator
from aggregator.evaluation_sum import EvaluationSum
from aggregator.held_state import HeldState
from aggregator.picking import RoundPicker
from aggregator.round_table import Attempt, RoundTable
from fedlt.aggregation import SumLayer, Sums, evaluation_block
from fedlt.aggregation.halves import AggregatorSide, Released, SumAborted
from fedlt.errors import FedltError
from fedlt.methods import Method, ServerContext
from fedlt.selection import DISCLOSURE

log = logging.getLogger("aggregator")


class RoundCommitter:
    """`layer` seals the method's part of a sum for the server step; `side` (its aggregator half-maker) sums
    the silos' evaluation counts where only silos hold the model."""

    def __init__(
        self,
        table: RoundTable,
        *,
        config: ConsortiumConfig,
        method: Method,
        layer: SumLayer,
        side: AggregatorSide,
        picker: RoundPicker,
        evaluator: Evaluator,
    ) -> None:
        self.table, self.config, self.method = table, config, method
        self.layer, self.side = layer, side
        self.picker, self.evaluator = picker, evaluator
        self.store = table.store
        # with held-out evaluation: how long recent rounds took (their metrics come a round later), and the
        # last state the evaluation-only round evaluated (counts recorded or not)
        self._seconds: dict[int, float] = {}
        self._final_evaluated = -1

    def round_due(self) -> bool:
        """A round the method needs, or with held-out evaluation the round that evaluates the last state
        (once it has run, or its metrics are recorded: after a restart too)."""
        held = self.table.held
        if held.round < self.table.total_rounds:
            return True
        return (
            self.config.plan.evaluation.held_out
            and held.round not in (0, self._final_evaluated)
            and not self.evaluator.has(held.round)
        )

    def stripped(self, attempt: Attempt, released: Released) -> Sums | Released:
        """The method's part of the contribution sum, sealed for its server step; with held-out evaluation the
        summed counts are kept for the commit first (unknown records where the tail guard zeroed every
        class: the round's silos were not the census set)."""
        counted = len(released.survivors)
        if not self.config.plan.evaluation.held_out:
            return self.layer.seal(attempt.schema, released.total, counted)
        schema, vector, counts = evaluation_block.split(attempt.schema, released.total)
        if counts.records is not None and len(attempt.sums.zeroed) == len(counts.records):
            counts = replace(counts, records=None)
        attempt.evaluation = counts
        return released if schema is None else self.layer.seal(schema, vector, counted)

    def next_state(
        self, attempt: Attempt, summed: Sums | Released, stop: threading.Event
    ) -> HeldState | None:
        """The server step, here on `Sums`; or, where only silos read the sum, the state every silo the sum
        counted reports (one state, each silo's signature kept with it: silos step only from a state all of
        them signed, so one that a counted silo did not report is not committed); None if stopping. The
        evaluation-only round steps nothing: the state stays."""
        table = self.table
        if attempt.only_evaluates:
            return table.held
        if isinstance(summed, Sums):
            context = ServerContext(attempt.round, self.config.consortium.seed)
            return HeldState.plain(self.method.server_step(table.held.model, summed, context), self.method)
        until = time.monotonic() + self.config.timeouts.stage
        with table.lock:
            table.wait(stop, lambda: table.all_in(attempt.readers, attempt.reports), until=until)
            if stop.is_set():
                return None
            reports = dict(attempt.reports)
        silent = sorted(set(attempt.readers) - set(reports))
        if silent:
            raise SumAborted(
                f"{', '.join(silent)} reported no next state, and silos step only from a state every "
                "silo that read the sum signed: not committed"
            )
        first = next(iter(reports.values()))
        differ = sorted(s for s, r in reports.items() if not r.same_state(first))
        if differ:
            raise SumAborted(
                f"silos computed different next states ({', '.join(differ)} differ): not committed"
            )
        return HeldState.reported(attempt.round, attempt.contributors, attempt.readers, reports)

    def commit(self, attempt: Attempt, held: HeldState) -> None:
        if attempt.only_evaluates:
            self._evaluated(attempt)
            return
        table = self.table
        timer = _Stopwatch()
        contributors = list(attempt.contributors)
        trained = table.held.trains
        with table.lock:  # a late disclosure may still arrive: commit one consistent set
            disclosed = dict(attempt.disclosed)
        evaluating = self.evaluator.begin(held.model) if held.model is not None else None
        self.store.commit_round(
            round_number=attempt.round,
            round_id=attempt.round_id,
            digest=held.digest,
            data=held.stored(),
            contributors=contributors,
            picked=attempt.participants if trained else None,
            disclosures={silo: (DISCLOSURE, values) for silo, values in disclosed.items()},
        )
        if trained:
            self.picker.committed(attempt.round, attempt.participants, disclosed)
        timer.lap("commit")
        with table.lock:
            table.held = held
            table.attempt = None
            table.let_down.clear()
        log.debug("round %d committed: %s", attempt.round, timer)
        seconds = round(time.perf_counter() - attempt.started, 3)
        if held.model is not None:
            self.evaluator.committed(held.model, contributors, seconds, evaluating)
        else:
            self._sum_evaluations(attempt, contributors, seconds)
        self._seconds[attempt.round] = seconds
        self._record_held_out(attempt, contributors)

    def _evaluated(self, attempt: Attempt) -> None:
        """The end of the evaluation-only round: no state to commit, the last one's metrics to record."""
        table = self.table
        contributors = list(attempt.contributors)
        self.store.audit(
            "round_evaluated",
            {"round": table.held.round, "round_id": attempt.round_id, "contributors": contributors},
        )
        with table.lock:
            table.attempt = None
            table.let_down.clear()
        self._final_evaluated = table.held.round
        self._record_held_out(attempt, contributors)

    def _record_held_out(self, attempt: Attempt, contributors: list[str]) -> None:
        """The summed held-out counts as the metrics of the state the round started from (round 0: the
        initial model, with the summed training records the shot groups come from)."""
        counts = attempt.evaluation
        if counts is None:
            return
        evaluated = attempt.round - 1
        if not counts.evaluated:
            log.info("round %d: not evaluated: its silos were not every silo of the roster", evaluated)
            return
        problems = counts.problems()
        if problems:
            log.warning("round %d: its held-out counts are not recorded: %s", evaluated, "; ".join(problems))
            return
        self.evaluator.counted(
            evaluated,
            counts.correct,
            counts.total,
            contributors,
            self._seconds.pop(evaluated, None),
            train_counts=counts.records,
        )

    def _sum_evaluations(self, attempt: Attempt, contributors: list[str], seconds: float) -> None:
        """Add the reporting silos' evaluation counts under the layer; send the sum back for them to read."""
        self.evaluator.announce(attempt.round, contributors, seconds)
        try:
            pending, steps = EvaluationSum.start(
                self.side,
                self.side.round_settings(self.layer.settings),
                self.method.model_spec.num_classes,
                round_number=attempt.round,
                round_id=attempt.round_id,
                reports=attempt.reports,
                contributors=contributors,
                seconds=seconds,
            )
        except FedltError as exc:
            log.warning("round %d: its evaluation counts could not be summed: %s", attempt.round, exc)
            return
        with self.table.lock:
            self.table.evaluation = pending
            for silo, step in steps.items():
                self.table.sessions.step(silo, attempt.round_id, "evaluation", step)


class _Stopwatch:
    """Where a round's time goes, for the operator's debug log."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.laps: list[str] = []

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self.laps.append(f"{what} {now - self.last:.3f} s")
        self.last = now

    def __str__(self) -> str:
        return ", ".join(self.laps)
