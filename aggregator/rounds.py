"""The round state machine: gather silos, publish a signed RoundSpec, drive the round's sums, commit.

Transport-free: the gRPC service hands in what silos send (`deliver`, `upload`) and maps `Refusal`s to status
codes; directives go out through `Sessions`, which knows their Protobuf form (the RoundSpec itself is signed
bytes, built by `privacy.roundspec`). One driver thread runs the rounds; the service threads only hand in
messages, under one lock.

Stages of an attempt: GATHERING (waiting for at least `min_silos` connected silos), COLLECTING (RoundSpec out,
then the round's sums stage by stage: `fedlt.aggregation.round_sums.AggregatorRound` over the configured
layer's aggregator half, census and tail guard included), then the server step and the commit. Where the layer
lets only silos read the contribution sum (ckks), the silos run the server step themselves and report the
sealed state, its digest and what the next round needs (`held_state`); the round commits only if every report
agrees, and their evaluation counts go through one more sum of the layer, whose total a silo reports back.
Each stage of a sum ends when every silo expected has answered, the rest have disconnected or refused the
attempt (`refuse`), or its deadline passes (the round's first stage waits for training, until the round's
deadline; later ones `timeouts.stage`); refusals that leave the attempt short of its floor end it at once.
A sum that cannot complete aborts the attempt, and the round is tried again; a round is never committed on a
partial set below the minimum. Which layer carries the sums is the layer's business: nothing here looks at its
name.

With held-out evaluation (`fedlt.aggregation.evaluation_block`) every round's contribution also carries the
silos' per-class counts on their held-out data for the state the round starts from: stripped from the sum
before the server step and recorded, once the round commits, as that state's metrics. After the last round one
more round carries the counts alone, for the last state; it commits no state (no attempt in the store, an
audit record instead) and the run is finished only once it has run.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

from aggregator.config import ConsortiumConfig
from aggregator.evaluation import Evaluator
from aggregator.evaluation_sum import EvaluationSum
from aggregator.held_state import HeldState, StateReport
from aggregator.picking import RoundPicker
from aggregator.sessions import Session, Sessions
from aggregator.store import Store, StoreError, now_ms
from fedlt.aggregation import Schema, SumLayer, Sums, evaluation_block, tail_guard
from fedlt.aggregation.evaluation_block import HeldOutCounts
from fedlt.aggregation.halves import (
    AggregatorSide,
    Released,
    SettingsRefused,
    SumAborted,
)
from fedlt.aggregation.round_sums import AggregatorRound
from fedlt.aggregation.tail_guard import Census
from fedlt.errors import FedltError
from fedlt.methods import Method, ServerContext
from fedlt.recorder import RunRecorder
from fedlt.selection import DISCLOSURE
from fedlt.v1 import round_pb2
from privacy import roundspec

log = logging.getLogger("aggregator")

_T = TypeVar("_T")


class Stage(StrEnum):
    GATHERING = "gathering"
    COLLECTING = "collecting"
    COMMITTING = "committing"
    FINISHED = "finished"


class Refusal(FedltError):
    """A request the round machine refuses; the service maps each kind to a gRPC status code."""


class WrongRound(Refusal):
    """The request names an attempt that is not the one in flight."""


class NotParticipant(Refusal):
    """The caller was not invited to the attempt in flight."""


class BadContribution(Refusal):
    """The payload does not fit the round's schema."""


class AlreadySubmitted(Refusal):
    """A different contribution was already accepted from this silo for this attempt."""


class AttemptRefused(FedltError):
    """Silos refused the attempt, and those left cannot reach the floor of silos its sum must count."""


@dataclass(frozen=True)
class SiloRefusal:
    """A silo's refusal of an attempt, in the words it sent; whether it still stands is the engine's
    `_standing`: for the state it refused to train from, from the session it still has."""

    round_id: str
    code: str
    text: str
    at_ms: int
    state_digest: str
    session: Session | None = field(compare=False, repr=False)

    def shown(self) -> dict:
        return {"round_id": self.round_id, "code": self.code, "text": self.text, "at_unix_ms": self.at_ms}


@dataclass
class Attempt:
    round: int
    round_id: str
    signed: round_pb2.SignedRoundSpec
    schema: Schema
    participants: list[str]
    deadline_ms: int
    state_bytes: bytes
    sums: AggregatorRound
    started: float = field(default_factory=time.perf_counter)
    disclosers: list[str] = field(default_factory=list)  # asked for the MFSC disclosure
    disclosed: dict[str, bytes] = field(default_factory=dict)  # silo -> its disclosure, kept if committed
    contributors: tuple[str, ...] = ()  # whom the contribution sum counted
    reports: dict[str, StateReport] = field(default_factory=dict)  # where silos step the model
    evaluation: HeldOutCounts | None = None  # the held-out counts of the starting state, summed with the rest
    refused: dict[str, SiloRefusal] = field(default_factory=dict)  # silo -> its refusal of this attempt

    def invites(self, silo_id: str) -> bool:
        return silo_id in self.participants or silo_id in self.disclosers

    @property
    def only_evaluates(self) -> bool:
        """The round after the last, with held-out evaluation: silos sum their counts and train nothing."""
        return evaluation_block.only_evaluates(self.schema)


class RoundEngine:
    """`layer` is the simulator's facade of the configured privacy layer (its name and settings); `side` its
    aggregator half-maker, with the consortium's keys; `roster` the silo ids the roster in force names (None:
    no roster, only the silos registered so far are known)."""

    def __init__(
        self,
        *,
        config: ConsortiumConfig,
        store: Store,
        method: Method,
        layer: SumLayer,
        side: AggregatorSide,
        sign: Callable[[bytes], bytes],
        recorder: RunRecorder | None,
        echo: Callable[[str], None] = print,
        roster: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.config = config
        self.roster = roster
        self.store = store
        self.method = method
        self.layer, self.side = layer, side
        self.sign = sign
        self.plan_toml = config.plan.to_toml()
        self.plan_sha256 = config.plan.sha256()
        self._lock = threading.Condition()
        self.sessions = Sessions(self._lock)
        self._last_contributed: dict[str, int] = {}
        self._let_down: set[str] = set()  # invited to train in an aborted attempt of this round, gave nothing
        self._refusals: dict[str, SiloRefusal] = {}  # each silo's latest refusal (`_standing`: which hold)
        self.attempt: Attempt | None = None
        self.failure: Exception | None = None
        self.stage = Stage.GATHERING
        self.held = self._load_state()
        self._evaluation: EvaluationSum | None = None  # where only silos hold the model
        # with held-out evaluation: how long recent rounds took (their metrics come a round later), the
        # evaluation-only rounds begun, and the last state such a round evaluated (counts recorded or not)
        self._seconds: dict[int, float] = {}
        self._evaluation_attempts = 0
        self._final_evaluated = -1
        # silos that never computed the kept census refuse RoundSpecs naming it: take it again over its silos
        self._census_doubted = False
        self.picker = RoundPicker(config.plan.selection, config.consortium.seed, store, method)
        self.evaluator = Evaluator(
            recorder=recorder,
            # evaluation may run beside the next round, so it has a method instance of its own; none where
            # only counts the silos summed arrive
            method=None if recorder is None or recorder.test is None else config.plan.build_method(),
            store=store,
            background=config.evaluation.background,
            echo=echo,
            total_rounds=lambda: self.total_rounds,
        )
        if self.held.model is not None:
            self.evaluator.catch_up(self.held.model)

    @property
    def recorder(self) -> RunRecorder | None:
        return self.evaluator.recorder

    # --- start-up ---------------------------------------------------------------------------------

    def _load_state(self) -> HeldState:
        self.store.bind(self.config.fingerprint())
        latest = self.store.latest_state()
        if latest is None:
            held = HeldState.plain(self.method.init_state(seed=self.config.consortium.seed), self.method)
            self.store.save_initial_state(held.digest, held.stored())
            return held
        try:
            held = HeldState.from_stored(latest.data, latest.round, latest.digest, self.method)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        abandoned = self.store.abandon_open_attempts("aggregator restarted")
        if abandoned:
            log.warning("abandoned attempts left open by a restart: %s", ", ".join(abandoned))
        return held

    @property
    def total_rounds(self) -> int:
        """Committed rounds plus those the method still needs (training rounds, then any closing phase)."""
        return self.held.round + self.held.remaining

    def _round_due(self) -> bool:
        """A round the method needs, or with held-out evaluation the round that evaluates the last state
        (once it has run, or its metrics are recorded: after a restart too)."""
        if self.held.round < self.total_rounds:
            return True
        return (
            self.config.plan.evaluation.held_out
            and self.held.round not in (0, self._final_evaluated)
            and not self.evaluator.has(self.held.round)
        )

    def _trains(self) -> bool:
        """Whether the coming round trains (else it wants every silo: a closing or evaluation-only round)."""
        return self.held.trains and self.held.round < self.total_rounds

    def _round_schema(self) -> Schema:
        """What the coming round sums: the method's fields, and the evaluation block with held-out
        evaluation (the silos derive the same from the state and the signed plan)."""
        held = self.held
        return self.config.plan.round_schema(held.schema, starting_round=held.round, remaining=held.remaining)

    # --- called by the service --------------------------------------------------------------------

    def connect(self, silo_id: str) -> Session:
        with self._lock:
            session = self.sessions.open(silo_id)
            if self.stage == Stage.FINISHED:
                self.sessions.finished([silo_id], self.held.round, self.held.digest)
            elif self.attempt is not None and self.attempt.invites(silo_id):
                self.sessions.round_spec([silo_id], self.attempt.signed)
            return session

    def disconnect(self, session: Session) -> None:
        self.sessions.close(session)

    def heartbeat(self, silo_id: str, activity: str, privacy_remaining: float | None = None) -> None:
        self.sessions.heartbeat(silo_id, activity, privacy_remaining)

    def state_for(self, silo_id: str, round_id: str) -> bytes:
        with self._lock:
            return self._invited(silo_id, round_id, disclosing=True).state_bytes

    def disclose(self, silo_id: str, round_id: str, name: str, shape: tuple[int, ...], values: bytes) -> str:
        """Keep one silo's disclosure (MFSC's masked class means), which its RoundSpec asked for."""
        with self._lock:
            attempt = self._invited(silo_id, round_id, disclosing=True)
            if silo_id not in attempt.disclosers or name != DISCLOSURE:
                raise NotParticipant(f"{round_id} does not ask {silo_id} for a {name!r} disclosure")
            if silo_id in attempt.disclosed:
                if attempt.disclosed[silo_id] == values:  # an identical resend: the same receipt
                    return hashlib.sha256(values).hexdigest()
                raise AlreadySubmitted(f"{silo_id} already disclosed other values for {round_id}")
            digest = self.picker.accept(silo_id, round_id, name, shape, values)
            attempt.disclosed[silo_id] = values
            self._lock.notify_all()
        log.info("round %d: %s disclosed its %s values", attempt.round, silo_id, name)
        return digest

    def deliver(self, silo_id: str, round_id: str, purpose: str, message: object) -> None:
        """Hand one silo's message to the round's open sum, or to the last round's evaluation sum (which runs
        beside the next round); its layer half refuses what does not belong."""
        with self._lock:
            pending = self._evaluation
            if purpose == "evaluation" and pending is not None:
                for silo, step in pending.receive(silo_id, round_id, message).items():
                    self.sessions.step(silo, round_id, purpose, step)
            else:
                self._invited(silo_id, round_id).sums.receive(silo_id, purpose, message)
            self._lock.notify_all()

    def upload_bytes(self, silo_id: str, round_id: str, purpose: str, kind: type) -> int:
        """How many bytes the upload a Submit stream announces must have (refused if none is due)."""
        with self._lock:
            return self._invited(silo_id, round_id).sums.upload_bytes(silo_id, purpose, kind)

    def upload(self, silo_id: str, round_id: str, purpose: str, message: object, digest: str) -> str:
        """`deliver` for a streamed upload, whose SHA-256 the service checked; a contribution is audited."""
        with self._lock:
            attempt = self._invited(silo_id, round_id)
            news = silo_id not in attempt.sums.half.answered
            attempt.sums.receive(silo_id, purpose, message)
            if purpose == "contribution":
                self._last_contributed[silo_id] = attempt.round
            self._lock.notify_all()
        if news and purpose == "contribution":
            self.store.record_contribution(round_id, silo_id, digest)
        return digest

    def download(self, silo_id: str, round_id: str, purpose: str) -> bytes:
        """What a silo fetches of an open sum (a CKKS sum), or of the last committed round's evaluations."""
        with self._lock:
            if purpose == "evaluation" and self._evaluation is not None:
                return self._evaluation.download(silo_id, round_id)
            return self._invited(silo_id, round_id).sums.download(silo_id, purpose)

    def report_state(self, silo_id: str, round_id: str, report: StateReport) -> None:
        """Keep the state a silo computed from the sum it decrypted (layers where only silos read sums)."""
        with self._lock:
            attempt = self._invited(silo_id, round_id)
            if silo_id not in attempt.contributors:
                raise NotParticipant(f"{silo_id} is not among the silos the sum of {round_id} counted")
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
            self._lock.notify_all()
        log.debug("round %d: %s reports state %s", attempt.round, silo_id, report.digest[:16])

    def evaluation_reported(
        self, silo_id: str, round_number: int, correct: list[int], total: list[int]
    ) -> None:
        """A silo's decryption of the evaluation sum it was sent: the operator's only view of accuracy."""
        with self._lock:
            pending = self._evaluation
            if pending is None:
                raise WrongRound(f"no evaluation of round {round_number} is waiting")
            first = pending.report(silo_id, round_number, correct, total)
            self._lock.notify_all()
        if first:
            self.evaluator.counted(round_number, correct, total, pending.contributors, pending.seconds)

    def refuse(self, silo_id: str, round_id: str, code: str, text: str) -> None:
        """A silo the attempt in flight invites will not take part: no stage waits for it from now on, the
        attempt ends at once if the silos left cannot reach its floor (`_short_of_floor`), and later attempts
        leave the silo out while its refusal stands (`_standing`). The first refusal of an attempt stands."""
        with self._lock:
            attempt = self._invited(silo_id, round_id, disclosing=True)
            if silo_id in attempt.refused:
                return
            refusal = SiloRefusal(
                round_id, code, text, now_ms(), self.held.digest, self.sessions.current(silo_id)
            )
            attempt.refused[silo_id] = self._refusals[silo_id] = refusal
            self._lock.notify_all()
        self.store.record_refusal(round_id, silo_id, code, text)
        log.warning(
            "round %d: %s refuses %s (%s): %s; it is left out of this round until it reconnects, or for %g s",
            attempt.round,
            silo_id,
            round_id,
            code,
            text,
            self.config.timeouts.round,
        )

    def _invited(self, silo_id: str, round_id: str, *, disclosing: bool = False) -> Attempt:
        """The attempt in flight, if it invites `silo_id` (to train, or also only to disclose)."""
        attempt = self.attempt
        if attempt is None or attempt.round_id != round_id:
            current = attempt.round_id if attempt else "none"
            raise WrongRound(f"no attempt {round_id!r} in flight (current: {current})")
        if silo_id not in attempt.participants and not (disclosing and silo_id in attempt.disclosers):
            raise NotParticipant(f"{silo_id} is not a participant of {round_id}")
        return attempt

    def status(self) -> dict:
        with self._lock:
            attempt = self.attempt
            sums = attempt.sums if attempt else None
            refused = self._standing()
            return {
                "committed_rounds": self.held.round,
                "stage": f"{self.stage}: {sums.purpose} sum, {sums.half.stage}" if sums else str(self.stage),
                "round_id": attempt.round_id if attempt else "",
                "deadline_ms": attempt.deadline_ms if attempt else 0,
                "participants": list(attempt.participants) if attempt else [],
                "submitted": sorted(sums.half.answered) if sums else [],
                "state_digest": self.held.digest,
                "silos": [
                    {
                        "silo_id": s,
                        **self.sessions.describe(s, seen),
                        "last_contributed_round": self._last_contributed.get(s, 0),
                        **({"refusal": refused[s].shown()} if s in refused else {}),
                    }
                    for s, seen in self.store.silos().items()
                ],
            }

    # --- the driver -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Drive rounds until done or stopped; an unexpected error is kept in `failure` for the caller."""
        try:
            self._run(stop)
        except Exception as exc:
            log.exception("the round driver stopped on an unexpected error")
            self.failure = exc
            stop.set()
        finally:
            self.evaluator.shutdown()

    def _run(self, stop: threading.Event) -> None:
        while self._round_due() and not stop.is_set():
            connected = self._gather(stop)
            if connected is None:
                break
            round_number = self.held.round + 1
            pinned = self._pinned(round_number, stop)
            if pinned is None:
                break
            picked = (
                (pinned, [])
                if pinned
                else self.picker.pick(self._trains(), round_number, connected, avoid=self._let_down)
            )
            attempt = self._start_attempt(*picked)
            self.store.checkpoint()  # while silos train: off the path between a commit and its RoundSpec
            try:
                summed = self._sums(attempt, stop)
                if summed is not None:
                    self._await_disclosures(attempt, stop)
                    held = self._next_state(attempt, summed, stop)
                if summed is None or held is None:
                    self._abort(attempt, "aggregator stopping")
                    break
                self._commit(attempt, held)
            except SettingsRefused as exc:
                self._abort(attempt, str(exc))
                raise  # the same round would overflow again: the operator must change the settings
            except FedltError as exc:
                self._abort(attempt, f"the round failed: {exc}")
        with self._lock:
            # the last round's evaluation, where silos compute it, before they are told the run is over
            until = time.monotonic() + self.config.timeouts.stage
            self._wait(stop, self._evaluations_in, until=until)
            if not self._round_due():
                self.stage = Stage.FINISHED
                self.sessions.finished(self.sessions.connected(), self.held.round, self.held.digest)
            self.attempt = None
            self._lock.notify_all()

    def _gather(self, stop: threading.Event) -> list[str] | None:
        """Wait for `min_silos` connections, then up to `gather` seconds for the rest (`_everyone_ready`)."""
        minimum = self.config.consortium.min_silos
        with self._lock:
            self.stage = Stage.GATHERING
            while not stop.is_set():
                if not self._wait(stop, lambda: len(self._ready()) >= minimum):
                    return None
                until = time.monotonic() + self.config.timeouts.gather
                self._wait(stop, self._everyone_ready, until=until)
                if len(self._ready()) >= minimum:
                    return self._ready()
            return None

    def _pinned(self, round_number: int, stop: threading.Event) -> list[str] | None:
        """The silos an earlier attempt of this round asked to release a sum for, once every one of them is
        connected: they refuse to release it for any other set (`silo.releases`), so the round can only be
        retried over exactly them. The contribution sum's set, or the census's while its phase has none kept
        (or the kept census's, while it is to be taken again); [] if no attempt got that far; None if
        stopping."""
        pins = self.store.pinned_releases(round_number)
        kept = self.store.census(self._phase(self._round_schema()))
        retaken = list(kept.silos) if kept is not None and self._census_doubted else None
        silos = pins.get("contribution") or (pins.get("census") if kept is None else retaken)
        if not silos:
            return []
        with self._lock:
            missing = sorted(set(silos) - set(self._ready()))
            if missing:
                log.warning(
                    "round %d waits for %s: %s were asked to release it and release it for no other set",
                    round_number,
                    ", ".join(missing),
                    ", ".join(silos),
                )
            if not self._wait(stop, lambda: set(silos) <= set(self._ready())):
                return None
        return silos

    def _evaluations_in(self) -> bool:
        """Every silo sent the last evaluation sum has reported its decryption, or is gone."""
        return self._evaluation is None or self._all_in(self._evaluation.waiting_for, ())

    def _all_in(self, expected: Collection[str], answered: Collection[str]) -> bool:
        """Every silo expected has answered, or is no longer connected (no one waits for the gone)."""
        return not (set(expected) - set(answered)) & self.sessions.connected()

    def _ready(self) -> list[str]:
        """Connected silos the layer can take (ckks: those the key holder has sealed the key to), less those
        whose refusal of the round stands: asked again, they would refuse again at once."""
        refused = self._standing()
        return sorted(s for s in self.sessions.connected() if self.side.eligible(s) and s not in refused)

    def _standing(self) -> dict[str, SiloRefusal]:
        """The refusals that still hold: of the state the next attempt trains from (the plan is the run's
        own, so the same state is the same ask), by a silo still on the session it refused from (one that
        reconnects may have a new policy), and younger than `timeouts.round` (a refusal for a passing reason,
        a CKKS key not yet fetched, is asked again then; a lasting one costs one short attempt a timeout)."""
        since = now_ms() - int(1000 * self.config.timeouts.round)
        return {
            silo: r
            for silo, r in self._refusals.items()
            if r.state_digest == self.held.digest
            and r.at_ms > since
            and self.sessions.current(silo) is r.session
        }

    def _short_of_floor(self, attempt: Attempt) -> str:
        """Why the attempt cannot complete once too few participants are left that did not refuse it ("" while
        enough are): it could only wait for its deadline and fail. A layer whose own threshold is higher fails
        its stage as soon as the silos left have answered. The reason names codes, not the silos' words: it
        goes to every participant in the Abort."""
        floor = self.config.consortium.min_silos
        left = [s for s in attempt.participants if s not in attempt.refused]
        if not attempt.refused or len(left) >= floor:
            return ""
        refused = ", ".join(f"{s} ({r.code})" for s, r in sorted(attempt.refused.items()))
        return (
            f"refused by {refused}: {len(left)} of {len(attempt.participants)} participants left, "
            f"fewer than min_silos {floor}"
        )

    def _everyone_ready(self) -> bool:
        """Every silo the roster names is ready, or, once a round is committed, every registered one. Before
        the first commit silos may still be starting and registering, so the silos registered so far being
        all connected ends no wait; later a roster member that never registered is not waited for each round.
        """
        ready = set(self._ready())
        if self.roster is not None and set(self.roster()) <= ready:
            return True
        return self.held.round > 0 and set(self.store.silos()) <= ready

    def _await_disclosures(self, attempt: Attempt, stop: threading.Event) -> None:
        """Give connected disclosers up to `timeouts.stage` more: the next round is picked from them."""
        until = time.monotonic() + self.config.timeouts.stage
        with self._lock:
            self._wait(
                stop,
                lambda: self._all_in(attempt.disclosers, {*attempt.disclosed, *attempt.refused}),
                until=until,
            )

    def _phase(self, schema: Schema) -> str:
        consortium = self.config.consortium
        return tail_guard.phase_key(consortium.id, self.plan_sha256, consortium.seed, schema.phase)

    def _start_attempt(self, participants: list[str], disclosers: list[str] | None = None) -> Attempt:
        """Sign the RoundSpec and open the round's first sum before the RoundSpec goes out, so no silo's first
        message can arrive before the sum that takes it."""
        disclosers = disclosers or []
        round_number = self.held.round + 1
        schema = self._round_schema()
        attempt_number, round_id = self._begin(round_number, participants, schema)
        guarded = bool(schema.classes) and self.layer.k_min >= 2
        deadline = now_ms() + int(1000 * self.config.timeouts.round)
        spec = roundspec.build(
            consortium_id=self.config.consortium.id,
            round_number=round_number,
            attempt=attempt_number,
            round_id=round_id,
            method=self.config.plan.method.name,
            plan_toml=self.plan_toml,
            schema=schema,
            state_digest=self.held.digest,
            state_bytes=len(self.held.blob),
            seed=self.config.consortium.seed,
            privacy=self.layer.name,
            settings=self.side.round_settings(self.layer.settings),
            participants=participants,
            disclosures=[DISCLOSURE] if disclosers else [],
            disclosers=disclosers,
            deadline_unix_ms=deadline,
            census=self._named_census(schema) if guarded else None,
            attested=self.held.attested,
        )
        signed = roundspec.sign(spec, self.sign)
        sums = AggregatorRound(
            self.side, roundspec.sums_of(signed, spec), min_contributors=self.config.consortium.min_silos
        )
        attempt = Attempt(
            round_number,
            round_id,
            signed,
            schema,
            participants,
            deadline,
            self.held.blob,
            sums,
            disclosers=disclosers,
        )
        with self._lock:
            self.attempt = attempt
            self.stage = Stage.COLLECTING
            self.sessions.round_spec(sorted({*participants, *disclosers}), signed)
        log.debug("round %d: attempt %s with %s", round_number, round_id, ", ".join(participants))
        return attempt

    def _begin(self, round_number: int, participants: list[str], schema: Schema) -> tuple[int, str]:
        """The attempt's number and id: a numbered attempt in the store, or, for the evaluation-only round,
        which commits no state, an audit record alone (its id says what it is: `r<round>.e<number>`)."""
        nonce = secrets.token_hex(4)
        if not evaluation_block.only_evaluates(schema):
            return self.store.begin_attempt(round_number, participants, nonce)
        self._evaluation_attempts += 1
        round_id = f"r{round_number}.e{self._evaluation_attempts}.{nonce}"
        self.store.audit("evaluation_started", {"round_id": round_id, "participants": participants})
        return self._evaluation_attempts, round_id

    def _sums(self, attempt: Attempt, stop: threading.Event) -> Sums | Released | None:
        """The round's sums stage by stage until the contribution sum is released: its `Sums`, or `Released`
        without a total where only silos can read it (or, in the evaluation-only round, where it holds the
        evaluation block alone); None if stopping."""
        sums, first, pinned = attempt.sums, True, set()
        while True:
            deadline = attempt.deadline_ms if first else now_ms() + int(1000 * self.config.timeouts.stage)
            if not self._await_stage(attempt, deadline, stop):
                return None
            first = False
            taken = sums.census_taken
            with self._lock:
                out = sums.close()
            if sums.census_taken is not None and taken is None:  # kept at once: silos sign one census a set
                self.store.save_census(self._phase(attempt.schema), sums.census_taken)
                self._census_doubted = False
            if isinstance(out, Released):
                break
            if sums.half.counted is not None and sums.purpose not in pinned:
                # the steps out ask silos to release the sum for this set: kept first, once a sum
                self.store.pin_release(attempt.round, sums.purpose, sums.half.counted)
                pinned.add(sums.purpose)
            for silo, purpose, step in out:
                self.sessions.step(silo, attempt.round_id, purpose, step)
        if sums.sums.guarded:
            guard = {
                "round_id": attempt.round_id,
                "k_min": sums.sums.k_min,
                "zeroed": sums.zeroed,
                "record_floor": sums.sums.record_floor,
                "floored": sums.floored,
            }
            self.store.audit("tail_guard", guard)
            if sums.zeroed or sums.floored:
                log.info(
                    "round %d: tail guard zeroed classes %s, and below the record floor %s",
                    attempt.round,
                    sums.zeroed,
                    sums.floored,
                )
        self._doubt_census(attempt, out.survivors)
        with self._lock:
            attempt.contributors = out.survivors
            self.stage = Stage.COMMITTING
        return out if out.total is None else self._stripped(attempt, out)

    def _stripped(self, attempt: Attempt, released: Released) -> Sums | Released:
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

    def _await_stage(self, attempt: Attempt, deadline_ms: int, stop: threading.Event) -> bool:
        """Wait until everyone expected has answered, refused or disconnected, or the deadline passes; a
        refusal that leaves the attempt short of its floor ends it at once (AttemptRefused)."""
        sums = attempt.sums

        def answered() -> bool:
            done = self._all_in(sums.half.expected, {*sums.half.answered, *attempt.refused})
            return done or bool(self._short_of_floor(attempt))

        with self._lock:
            self._wait(stop, answered, until=time.monotonic() + max(0.0, (deadline_ms - now_ms()) / 1000))
            if stop.is_set():
                return False
            short = self._short_of_floor(attempt)
        if short:
            raise AttemptRefused(short)
        return True

    def _next_state(
        self, attempt: Attempt, summed: Sums | Released, stop: threading.Event
    ) -> HeldState | None:
        """The server step, here on `Sums`; or, where only silos read the sum, the state every silo the sum
        counted reports (one state, each silo's signature kept with it: silos step only from a state all of
        them signed, so one that a counted silo did not report is not committed); None if stopping. The
        evaluation-only round steps nothing: the state stays."""
        if attempt.only_evaluates:
            return self.held
        if isinstance(summed, Sums):
            context = ServerContext(attempt.round, self.config.consortium.seed)
            return HeldState.plain(self.method.server_step(self.held.model, summed, context), self.method)
        until = time.monotonic() + self.config.timeouts.stage
        with self._lock:
            self._wait(stop, lambda: self._all_in(attempt.contributors, attempt.reports), until=until)
            if stop.is_set():
                return None
            reports = dict(attempt.reports)
        silent = sorted(set(attempt.contributors) - set(reports))
        if silent:
            raise SumAborted(
                f"{', '.join(silent)} reported no next state, and silos step only from a state every "
                "silo the sum counted signed: not committed"
            )
        first = next(iter(reports.values()))
        differ = sorted(s for s, r in reports.items() if not r.same_state(first))
        if differ:
            raise SumAborted(
                f"silos computed different next states ({', '.join(differ)} differ): not committed"
            )
        return HeldState.reported(attempt.round, attempt.contributors, reports)

    def _commit(self, attempt: Attempt, held: HeldState) -> None:
        if attempt.only_evaluates:
            self._evaluated(attempt)
            return
        timer = _Stopwatch()
        contributors = list(attempt.contributors)
        trained = self.held.trains
        with self._lock:  # a late disclosure may still arrive: commit one consistent set
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
        with self._lock:
            self.held = held
            self.attempt = None
            self._let_down.clear()
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
        contributors = list(attempt.contributors)
        self.store.audit(
            "round_evaluated",
            {"round": self.held.round, "round_id": attempt.round_id, "contributors": contributors},
        )
        with self._lock:
            self.attempt = None
            self._let_down.clear()
        self._final_evaluated = self.held.round
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
        with self._lock:
            self._evaluation = pending
            for silo, step in steps.items():
                self.sessions.step(silo, attempt.round_id, "evaluation", step)

    def _named_census(self, schema: Schema) -> Census | None:
        """The census a RoundSpec names: the one kept for the phase, unless silos seem not to hold it."""
        return None if self._census_doubted else self.store.census(self._phase(schema))

    def _doubt_census(self, attempt: Attempt, counted: Collection[str]) -> None:
        """A silo keeps a census only once it computed it, and takes no other on trust: when an attempt naming
        the census fails, or every census silo was invited but some sent nothing, the next attempt takes the
        census again over its silos (which they allow: the same silos, the same presence)."""
        named = attempt.sums.sums.census
        if (
            named is not None
            and set(named.silos) <= set(attempt.participants)
            and set(counted) != set(named.silos)
        ):
            self._census_doubted = True
            log.warning(
                "round %d: census silos %s did not all take part; the census is taken again over them",
                attempt.round,
                ", ".join(sorted(set(named.silos) - set(counted))),
            )

    def _abort(self, attempt: Attempt, reason: str) -> None:
        self._doubt_census(attempt, ())
        self.store.abort_attempt(attempt.round_id, reason)
        with self._lock:
            self._let_down.update(
                s for s in attempt.participants if self._last_contributed.get(s) != attempt.round
            )
            self.sessions.abort(
                sorted({*attempt.participants, *attempt.disclosers}), attempt.round_id, reason
            )
            self.attempt = None
        log.warning("round %d: attempt %s aborted: %s", attempt.round, attempt.round_id, reason)

    def _wait(
        self, stop: threading.Event, predicate: Callable[[], bool], *, until: float | None = None
    ) -> bool:
        """Wait on the lock (held by the caller) until `predicate`, `stop`, or `until` (monotonic)."""
        while not predicate():
            if stop.is_set():
                return False
            left = 0.5 if until is None else min(0.5, until - time.monotonic())
            if left <= 0:
                return False
            self._lock.wait(left)
        return True


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
