"""What the round driver and the inbox share, and the attendance rules both read from it.

One lock guards it all: the silos' sessions, the attempt in flight and its stage, the state held, each silo's
latest refusal, who contributed when, and the last round's evaluation sum where silos compute it. The lock is
a Condition: the inbox (`aggregator.inbox`) notifies it whenever it takes a message, and the sessions
whenever a silo connects or disconnects, so the driver (`aggregator.rounds`), which waits on it (`wait`),
wakes to every change. The attendance rules say whom a round may invite (`ready`), whose refusals still
hold (`standing`), when a stage has heard from everyone it waits for (`all_in`), and when refusals leave an
attempt unable to complete (`short_of_floor`).

The sessions (`Sessions`) are the silos connected right now: one open Join stream each (`Session`), its
directive queue, its last heartbeat. The directives themselves (RoundSpec, a sum's step, abort, finished) are
made there, in their Protobuf form, so the driver deals in rounds and sums, not in messages.

The attempt of a round, the stages the aggregator goes through, and what it refuses of what silos send: both
sides of the round machine use these. The inbox (`aggregator.inbox`) checks what the service hands in against
the `Attempt` in flight and raises a `Refusal`, which the service maps to a gRPC status code; the driver
(`aggregator.rounds`) opens attempts, moves the `Stage` on, and ends an attempt that silos' refusals
(`SiloRefusal`) leave short of its floor (`AttemptRefused`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from aggregator.config import ConsortiumConfig
from aggregator.evaluation_sum import EvaluationSum
from aggregator.held_state import HeldState, StateReport
from aggregator.store import Store, now_ms
from fedlt.aggregation import Schema, evaluation_block
from fedlt.aggregation.evaluation_block import HeldOutCounts
from fedlt.aggregation.round_sums import AggregatorRound
from fedlt.errors import FedltError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.wire import step_to_pb

log = logging.getLogger("aggregator")


@dataclass
class Session:
    """One open Join stream; a reconnecting silo replaces its older session."""

    silo_id: str
    directives: queue.Queue = field(default_factory=queue.Queue)
    activity: str = "idle"
    last_seen_ms: int = field(default_factory=now_ms)
    closed: bool = False
    privacy_remaining: float | None = None  # only if the silo reports it


# A silo that replaces a session still open this often within a minute is likely two agents under one
# certificate, each taking the silo's place from the other (a reconnect replaces one now and then).
TAKEOVERS, TAKEOVER_WINDOW_MS = 3, 60_000


class Sessions:
    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._open: dict[str, Session] = {}
        self._takeovers: dict[str, list[int]] = {}

    def open(self, silo_id: str) -> Session:
        """A new session for `silo_id`, ending the one it replaces (call with the lock held)."""
        old = self._open.get(silo_id)
        if old is not None:
            old.closed = True
            old.directives.put(None)
            self._took_over(silo_id)
        session = self._open[silo_id] = Session(silo_id)
        self._lock.notify_all()
        return session

    def _took_over(self, silo_id: str) -> None:
        """Say so when a silo keeps replacing its own open session: two agents of one silo (each with its own
        state directory, so neither stops the other) would stall every round, and nothing else tells."""
        now = now_ms()
        recent = [t for t in self._takeovers.get(silo_id, []) if now - t < TAKEOVER_WINDOW_MS] + [now]
        self._takeovers[silo_id] = recent
        if len(recent) == TAKEOVERS:
            log.warning(
                "%s connected %d times within a minute while its session was open: are two agents running "
                "with its certificate? Each takes the silo's place from the other and no round completes; "
                "stop all but one (one agent, one state directory per silo)",
                silo_id,
                TAKEOVERS,
            )

    def close(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            if self._open.get(session.silo_id) is session:
                del self._open[session.silo_id]
            self._lock.notify_all()

    def end_all(self) -> None:
        """End every open session (the study stops serving: its silos reconnect and are told why)."""
        with self._lock:
            for session in self._open.values():
                session.closed = True
                session.directives.put(None)
            self._open.clear()
            self._lock.notify_all()

    def heartbeat(self, silo_id: str, activity: str, privacy_remaining: float | None = None) -> None:
        with self._lock:
            session = self._open.get(silo_id)
            if session is not None:
                session.activity = activity
                session.last_seen_ms = now_ms()
                session.privacy_remaining = privacy_remaining

    def connected(self) -> set[str]:
        return set(self._open)

    def current(self, silo_id: str) -> Session | None:
        """The silo's open session: a refusal made on another one no longer stands."""
        return self._open.get(silo_id)

    def round_spec(self, silos: Iterable[str], signed: round_pb2.SignedRoundSpec) -> None:
        self._send(silos, pb.JoinResponse(round_spec=signed))

    def step(self, silo: str, round_id: str, purpose: str, step: object) -> None:
        """One stage output of a sum (any layer's; `privacy.wire` knows its Protobuf form)."""
        self._send([silo], pb.JoinResponse(sum_step=step_to_pb(round_id, purpose, step)))

    def abort(self, silos: Iterable[str], round_id: str, reason: str) -> None:
        self._send(silos, pb.JoinResponse(abort=pb.Abort(round_id=round_id, reason=reason)))

    def finished(self, silos: Iterable[str], rounds: int, state_digest: str) -> None:
        self._send(silos, pb.JoinResponse(finished=pb.Finished(rounds=rounds, state_digest=state_digest)))

    def _send(self, silos: Iterable[str], directive: pb.JoinResponse) -> None:
        """Queue `directive` for each of `silos` that is connected (the others get it when they rejoin)."""
        with self._lock:
            for silo in silos:
                if silo in self._open:
                    self._open[silo].directives.put(directive)

    def describe(self, silo_id: str, last_seen_ms: int) -> dict:
        session = self._open.get(silo_id)
        described = {
            "connected": session is not None,
            "last_seen_unix_ms": session.last_seen_ms if session else last_seen_ms,
            "activity": session.activity if session else "offline",
        }
        if session is not None and session.privacy_remaining is not None:
            described["privacy_remaining"] = session.privacy_remaining
        return described


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
    """A silo's refusal of an attempt, in the words it sent; whether it still stands is the round table's
    `standing`: for the state it refused to train from, from the session it still has."""

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
    readers: tuple[str, ...] = ()  # where silos step: who read the sum (blind: may be fewer than counted)
    reports: dict[str, StateReport] = field(default_factory=dict)  # where silos step the model
    evaluation: HeldOutCounts | None = None  # the held-out counts of the starting state, summed with the rest
    refused: dict[str, SiloRefusal] = field(default_factory=dict)  # silo -> its refusal of this attempt

    def invites(self, silo_id: str) -> bool:
        return silo_id in self.participants or silo_id in self.disclosers

    @property
    def only_evaluates(self) -> bool:
        """The round after the last, with held-out evaluation: silos sum their counts and train nothing."""
        return evaluation_block.only_evaluates(self.schema)


class RoundTable:
    """`eligible`: whether the layer can take a connected silo (ckks: once the key holder has sealed the key
    to it); `roster`: the silo ids the roster in force names (None: no roster, only the silos registered so
    far are known). Read and write every field with `lock` held."""

    def __init__(
        self,
        *,
        config: ConsortiumConfig,
        store: Store,
        held: HeldState,
        eligible: Callable[[str], bool],
        roster: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.config, self.store, self.eligible, self.roster = config, store, eligible, roster
        self.lock = threading.Condition()
        self.sessions = Sessions(self.lock)
        self.held = held
        self.attempt: Attempt | None = None
        self.aborted: Attempt | None = None  # the last attempt aborted: refusals may still arrive for it
        self.stage = Stage.GATHERING
        self.last_contributed: dict[str, int] = {}
        self.let_down: set[str] = set()  # invited to train in an aborted attempt of this round, gave nothing
        self.refusals: dict[str, SiloRefusal] = {}  # each silo's latest refusal (`standing`: which hold)
        self.evaluation: EvaluationSum | None = None  # the last round's, where only silos hold the model

    @property
    def total_rounds(self) -> int:
        """Committed rounds plus those the method still needs (training rounds, then any closing phase)."""
        return self.held.round + self.held.remaining

    def invited(
        self, silo_id: str, round_id: str, *, disclosing: bool = False, aborted: bool = False
    ) -> Attempt:
        """The attempt in flight, if it invites `silo_id` (to train, or also only to disclose); with
        `aborted`, also the last attempt aborted (a refusal sent as another silo's ended it is still news)."""
        attempt = self.attempt
        if aborted and (attempt is None or attempt.round_id != round_id) and self.aborted is not None:
            attempt = self.aborted
        if attempt is None or attempt.round_id != round_id:
            current = attempt.round_id if attempt else "none"
            raise WrongRound(f"no attempt {round_id!r} in flight (current: {current})")
        if silo_id not in attempt.participants and not (disclosing and silo_id in attempt.disclosers):
            raise NotParticipant(f"{silo_id} is not a participant of {round_id}")
        return attempt

    def ready(self) -> list[str]:
        """Connected silos the layer can take (ckks: those the key holder has sealed the key to), less those
        whose refusal of the round stands: asked again, they would refuse again at once."""
        refused = self.standing()
        return sorted(s for s in self.sessions.connected() if self.eligible(s) and s not in refused)

    def standing(self) -> dict[str, SiloRefusal]:
        """The refusals that still hold: of the state the next attempt trains from (the plan is the run's
        own, so the same state is the same ask), by a silo still on the session it refused from (one that
        reconnects may have a new policy), and younger than `timeouts.round` (a refusal for a passing reason,
        a CKKS key not yet fetched, is asked again then; a lasting one costs one short attempt a timeout)."""
        since = now_ms() - int(1000 * self.config.timeouts.round)
        return {
            silo: r
            for silo, r in self.refusals.items()
            if r.state_digest == self.held.digest
            and r.at_ms > since
            and self.sessions.current(silo) is r.session
        }

    def all_in(self, expected: Collection[str], answered: Collection[str]) -> bool:
        """Every silo expected has answered, or is no longer connected (no one waits for the gone)."""
        return not (set(expected) - set(answered)) & self.sessions.connected()

    def short_of_floor(self, attempt: Attempt) -> str:
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

    def everyone_ready(self) -> bool:
        """Every silo the roster names is ready, or, once a round is committed, every registered one. Before
        the first commit silos may still be starting and registering, so the silos registered so far being
        all connected ends no wait; later a roster member that never registered is not waited for each round.
        """
        ready = set(self.ready())
        if self.roster is not None and set(self.roster()) <= ready:
            return True
        return self.held.round > 0 and set(self.store.silos()) <= ready

    def evaluations_in(self) -> bool:
        """Every silo sent the last evaluation sum has reported its decryption, or is gone."""
        return self.evaluation is None or self.all_in(self.evaluation.waiting_for, ())

    def wait(
        self, stop: threading.Event, predicate: Callable[[], bool], *, until: float | None = None
    ) -> bool:
        """Wait on the lock (held by the caller) until `predicate`, `stop`, or `until` (monotonic)."""
        while not predicate():
            if stop.is_set():
                return False
            left = 0.5 if until is None else min(0.5, until - time.monotonic())
            if left <= 0:
                return False
            self.lock.wait(left)
        return True
