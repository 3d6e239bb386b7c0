"""What the gRPC service hands the round machine, checked against the attempt in flight.

Transport-free: the service (`aggregator.service`) reads who is calling from the certificate and decodes the
request; the inbox takes the message (`deliver`, `upload`, `report_state`, a disclosure or a refusal) under
the round table's one lock, refuses what does not belong to the attempt in flight with a `Refusal` (which
the service maps to a status code), and notifies the lock so the driver (`aggregator.rounds`) wakes. What a
sum's stage takes is its layer half's business (`sums.receive`): nothing here looks at the layer's name.
"""

from __future__ import annotations

import hashlib
import logging

from aggregator.config import ConsortiumConfig
from aggregator.evaluation import Evaluator
from aggregator.held_state import StateReport
from aggregator.picking import RoundPicker
from aggregator.round_table import (
    AlreadySubmitted,
    BadContribution,
    NotParticipant,
    RoundTable,
    Session,
    SiloRefusal,
    Stage,
    WrongRound,
)
from aggregator.store import now_ms
from fedlt.selection import DISCLOSURE

log = logging.getLogger("aggregator")


class RoundInbox:
    """The service's one door to the rounds: every method takes the table's lock for what it reads or keeps
    (`disconnect` and `heartbeat` through the sessions, which take it themselves)."""

    def __init__(self, table: RoundTable, *, picker: RoundPicker, evaluator: Evaluator) -> None:
        self.table, self.picker, self.evaluator = table, picker, evaluator
        self.config: ConsortiumConfig = table.config

    @property
    def total_rounds(self) -> int:
        return self.table.total_rounds

    def connect(self, silo_id: str) -> Session:
        table = self.table
        with table.lock:
            session = table.sessions.open(silo_id)
            if table.stage == Stage.FINISHED:
                table.sessions.finished([silo_id], table.held.round, table.held.digest)
            elif table.attempt is not None and table.attempt.invites(silo_id):
                table.sessions.round_spec([silo_id], table.attempt.signed)
            return session

    def disconnect(self, session: Session) -> None:
        self.table.sessions.close(session)

    def heartbeat(self, silo_id: str, activity: str, privacy_remaining: float | None = None) -> None:
        self.table.sessions.heartbeat(silo_id, activity, privacy_remaining)

    def state_for(self, silo_id: str, round_id: str) -> bytes:
        with self.table.lock:
            return self.table.invited(silo_id, round_id, disclosing=True).state_bytes

    def disclose(self, silo_id: str, round_id: str, name: str, shape: tuple[int, ...], values: bytes) -> str:
        """Keep one silo's disclosure (MFSC's masked class means), which its RoundSpec asked for."""
        with self.table.lock:
            attempt = self.table.invited(silo_id, round_id, disclosing=True)
            if silo_id not in attempt.disclosers or name != DISCLOSURE:
                raise NotParticipant(f"{round_id} does not ask {silo_id} for a {name!r} disclosure")
            if silo_id in attempt.disclosed:
                if attempt.disclosed[silo_id] == values:  # an identical resend: the same receipt
                    return hashlib.sha256(values).hexdigest()
                raise AlreadySubmitted(f"{silo_id} already disclosed other values for {round_id}")
            digest = self.picker.accept(silo_id, round_id, name, shape, values)
            attempt.disclosed[silo_id] = values
            self.table.lock.notify_all()
        log.info("round %d: %s disclosed its %s values", attempt.round, silo_id, name)
        return digest

    def deliver(self, silo_id: str, round_id: str, purpose: str, message: object) -> None:
        """Hand one silo's message to the round's open sum, or to the last round's evaluation sum (which runs
        beside the next round); its layer half refuses what does not belong."""
        table = self.table
        with table.lock:
            pending = table.evaluation
            if purpose == "evaluation" and pending is not None:
                for silo, step in pending.receive(silo_id, round_id, message).items():
                    table.sessions.step(silo, round_id, purpose, step)
            else:
                table.invited(silo_id, round_id).sums.receive(silo_id, purpose, message)
            table.lock.notify_all()

    def upload_bytes(self, silo_id: str, round_id: str, purpose: str, kind: type) -> int:
        """How many bytes the upload a Submit stream announces must have (refused if none is due)."""
        with self.table.lock:
            return self.table.invited(silo_id, round_id).sums.upload_bytes(silo_id, purpose, kind)

    def upload(self, silo_id: str, round_id: str, purpose: str, message: object, digest: str) -> str:
        """`deliver` for a streamed upload, whose SHA-256 the service checked; a contribution is audited."""
        table = self.table
        with table.lock:
            attempt = table.invited(silo_id, round_id)
            news = silo_id not in attempt.sums.half.answered
            attempt.sums.receive(silo_id, purpose, message)
            if purpose == "contribution":
                table.last_contributed[silo_id] = attempt.round
            table.lock.notify_all()
        if news and purpose == "contribution":
            table.store.record_contribution(round_id, silo_id, digest)
        return digest

    def download(self, silo_id: str, round_id: str, purpose: str) -> bytes:
        """What a silo fetches of an open sum (a CKKS sum), or of the last committed round's evaluations."""
        with self.table.lock:
            if purpose == "evaluation" and self.table.evaluation is not None:
                return self.table.evaluation.download(silo_id, round_id)
            return self.table.invited(silo_id, round_id).sums.download(silo_id, purpose)

    def readers(self, silo_id: str, round_id: str) -> tuple[str, ...]:
        """Who read `round_id`'s sum, as its state's signatures must name them (where silos step)."""
        with self.table.lock:
            return self.table.invited(silo_id, round_id).readers

    def report_state(self, silo_id: str, round_id: str, report: StateReport) -> None:
        """Keep the state a silo computed from the sum it decrypted (layers where only silos read sums)."""
        with self.table.lock:
            attempt = self.table.invited(silo_id, round_id)
            if silo_id not in attempt.readers:
                raise NotParticipant(f"{silo_id} is not among the silos that read the sum of {round_id}")
            if (report.round, report.counted) != (attempt.round, attempt.contributors):
                raise BadContribution(
                    f"{silo_id} signed its state as round {report.round}'s from a sum of "
                    f"{', '.join(report.counted)}; {round_id} is round {attempt.round}, its sum counted "
                    f"{', '.join(attempt.contributors)}"
                )
            kept = attempt.reports.get(silo_id)
            if kept is not None and not kept.same_state(report):
                raise AlreadySubmitted(f"{silo_id} already reported another state for {round_id}")
            attempt.reports.setdefault(silo_id, report)
            self.table.lock.notify_all()
        log.debug("round %d: %s reports state %s", attempt.round, silo_id, report.digest[:16])

    def evaluation_reported(
        self, silo_id: str, round_number: int, correct: list[int], total: list[int]
    ) -> None:
        """A silo's decryption of the evaluation sum it was sent: the operator's only view of accuracy."""
        with self.table.lock:
            pending = self.table.evaluation
            if pending is None:
                raise WrongRound(f"no evaluation of round {round_number} is waiting")
            first = pending.report(silo_id, round_number, correct, total)
            self.table.lock.notify_all()
        if first:
            self.evaluator.counted(round_number, correct, total, pending.contributors, pending.seconds)

    def refuse(self, silo_id: str, round_id: str, code: str, text: str) -> None:
        """A silo the attempt in flight invites will not take part: no stage waits for it from now on, the
        attempt ends at once if the silos left cannot reach its floor (`RoundTable.short_of_floor`), and later
        attempts leave the silo out while its refusal stands (`RoundTable.standing`). The first refusal of an
        attempt stands; one for the attempt just aborted (another silo's refusal ended it first) is kept and
        shown all the same."""
        table = self.table
        with table.lock:
            attempt = table.invited(silo_id, round_id, disclosing=True, aborted=True)
            if silo_id in attempt.refused:
                return
            refusal = SiloRefusal(
                round_id, code, text, now_ms(), table.held.digest, table.sessions.current(silo_id)
            )
            attempt.refused[silo_id] = table.refusals[silo_id] = refusal
            table.lock.notify_all()
        table.store.record_refusal(round_id, silo_id, code, text)
        log.warning(
            "round %d: %s refuses %s (%s): %s; it is left out of this round until it reconnects, or for %g s",
            attempt.round,
            silo_id,
            round_id,
            code,
            text,
            self.config.timeouts.round,
        )

    def status(self) -> dict:
        """What the operator sees (the status RPC, the status page): the round in flight and every silo."""
        table = self.table
        with table.lock:
            attempt = table.attempt
            sums = attempt.sums if attempt else None
            refused = table.standing()
            return {
                "committed_rounds": table.held.round,
                "stage": f"{table.stage}: {sums.purpose} sum, {sums.half.stage}"
                if sums
                else str(table.stage),
                "round_id": attempt.round_id if attempt else "",
                "deadline_ms": attempt.deadline_ms if attempt else 0,
                "participants": list(attempt.participants) if attempt else [],
                "submitted": sorted(sums.half.answered) if sums else [],
                "state_digest": table.held.digest,
                "silos": [
                    {
                        "silo_id": s,
                        **table.sessions.describe(s, seen),
                        "last_contributed_round": table.last_contributed.get(s, 0),
                        **({"refusal": refused[s].shown()} if s in refused else {}),
                    }
                    for s, seen in table.store.silos().items()
                ],
            }
