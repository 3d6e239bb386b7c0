"""Accuracy where only silos hold the model (ckks): a sum of the silos' evaluation counts, one silo reads it.

After a round whose state silos computed, each reporting silo's evaluation counts (an upload of the round's
layer, sent with its state report) are added by the layer's aggregator half; the sum goes back to those silos,
which take the layer's later stages (ckks: each signs the sum it was handed, `receive`, and decrypts only once
all have signed the same one), then report the per-class totals, which become the round's metrics. Pure
bookkeeping: the committer starts it and the inbox hands it what silos send, both under the round table's
lock, and they send the steps it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from aggregator.held_state import StateReport
from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    BadMessage,
    Released,
    SumAborted,
    SumSpec,
    evaluation_schema,
)

log = logging.getLogger("aggregator")


class NoEvaluationWaiting(SumAborted):
    """A silo reports or fetches an evaluation sum that is not the one waiting for it."""


@dataclass
class EvaluationSum:
    round: int
    round_id: str
    half: AggregatorHalf
    contributors: list[str]
    seconds: float
    reported: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # silo -> its decryption

    @classmethod
    def start(
        cls,
        side: AggregatorSide,
        settings: object,
        classes: int,
        *,
        round_number: int,
        round_id: str,
        reports: Mapping[str, StateReport],
        contributors: list[str],
        seconds: float,
    ) -> tuple[EvaluationSum, Mapping[str, object]]:
        """The sum of the reports' evaluation uploads, and the step that hands it to each reporting silo."""
        silos = tuple(sorted(reports))
        half = side.half(
            SumSpec(round_id, "evaluation", silos, evaluation_schema(classes), settings=settings)
        )
        for silo in silos:
            half.receive(silo, reports[silo].evaluation)
        steps = half.close()
        return cls(round_number, round_id, half, contributors, seconds), steps

    def receive(self, silo: str, round_id: str, message: object) -> Mapping[str, object]:
        """One silo's message for the sum's open stage; once every silo expected has sent one, the stage is
        closed and each silo's next step returned (nothing waits on a deadline here: a silo that never
        answers leaves the round without metrics, as one that never reports does)."""
        if round_id != self.round_id:
            raise NoEvaluationWaiting(f"no evaluation sum of {round_id} takes messages")
        self.half.receive(silo, message)
        if set(self.half.expected) - self.half.answered:
            return {}
        steps = self.half.close()
        assert not isinstance(steps, Released)  # a stage silos answer is never a sum's last
        return steps

    @property
    def waiting_for(self) -> set[str]:
        return set(self.half.spec.silos) - set(self.reported)

    def download(self, silo: str, round_id: str) -> bytes:
        if round_id != self.round_id:
            raise NoEvaluationWaiting(f"no evaluation sum of {round_id} to fetch")
        return self.half.download(silo)

    def report(self, silo: str, round_number: int, correct: list[int], total: list[int]) -> bool:
        """Keep one silo's reading of the sum; True for the first, which is the round's metrics."""
        classes = self.half.spec.schema.size // 2
        if (
            len(correct) != classes
            or len(total) != classes
            or any(c > t for c, t in zip(correct, total, strict=True))
        ):
            raise BadMessage(f"evaluation counts are {classes} correct and {classes} total, correct ≤ total")
        if round_number != self.round or silo not in self.half.spec.silos:
            raise NoEvaluationWaiting(f"no evaluation of round {round_number} is waiting for {silo}")
        first = not self.reported
        if not first and next(iter(self.reported.values())) != (correct, total):
            log.warning("round %d: %s decrypted other evaluation counts than the first", round_number, silo)
        self.reported.setdefault(silo, (correct, total))
        return first
