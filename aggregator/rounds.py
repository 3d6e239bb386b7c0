"""The round state machine: gather silos, publish a signed RoundSpec, collect contributions, sum, commit.

Transport-free: the gRPC service translates calls into the methods below and maps `Refusal`s to status codes,
so the machine is the same whether driven by a network or by a test. One driver thread runs the rounds; the
service threads only hand in what silos send, under one lock.

Stages of an attempt: GATHERING (waiting for at least `min_silos` connected silos), COLLECTING (RoundSpec out,
contributions coming in until every participant has answered, the connected ones have and there are enough,
or the deadline passes), then the sum, the server step and the commit. With fewer than `min_silos`
contributions at the deadline the attempt is aborted and the round is tried again; a round is never committed
on a partial set below the minimum.

With the `secagg` layer, COLLECTING runs the round's secure sums instead: the census when the schema has
per-class fields and the tail guard is on, then the contribution, each through the five protocol stages of
`privacy.secagg.protocol`. A stage ends when everyone expected has answered, the rest have disconnected, or
its deadline passes (the first waits for training, until the round's deadline; later ones `timeouts.stage`).
The aggregator keeps only the running sum of masked inputs, relays what is addressed to others, and learns
the unmasked sum; a silo that leaves after its masked input still counts, one that leaves before is
recovered from its peers' shares.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TypeVar

import numpy as np
import torch

from aggregator.config import ConsortiumConfig
from aggregator.picking import RoundPicker
from aggregator.store import Store, StoreError, now_ms
from fedlt.aggregation import Contribution, Schema, SumLayer, Sums
from fedlt.errors import ContributionError, FedltError
from fedlt.methods import GlobalState, Method, ServerContext
from fedlt.methods.state import pack_state, unpack_state
from fedlt.recorder import RunRecorder, round_line
from fedlt.selection import DISCLOSURE
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.secagg import tail_guard, wire
from privacy.secagg.codec import FixedPointCodec, OverflowRisk
from privacy.secagg.protocol import Peers, SecAggError, SecAggServer
from privacy.secagg.tail_guard import Census

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


class RoundFailed(FedltError):
    """An attempt that cannot be committed; it is aborted and the round is tried again."""


@dataclass
class Session:
    """One open Join stream; a reconnecting silo replaces its older session."""

    silo_id: str
    directives: queue.Queue = field(default_factory=queue.Queue)
    activity: str = "idle"
    last_seen_ms: int = field(default_factory=now_ms)
    closed: bool = False


@dataclass
class Attempt:
    round: int
    round_id: str
    signed: round_pb2.SignedRoundSpec
    schema: Schema
    participants: list[str]
    deadline_ms: int
    state_bytes: bytes
    started: float = field(default_factory=time.perf_counter)
    disclosers: list[str] = field(default_factory=list)  # asked for the MFSC disclosure
    submissions: dict[str, Contribution] = field(default_factory=dict)
    receipts: dict[str, str] = field(default_factory=dict)
    disclosed: dict[str, bytes] = field(default_factory=dict)  # silo -> its disclosure, kept if committed
    census: Census | None = None  # the phase's census, when an earlier attempt took it
    secure: SecAggServer | None = None  # the secure sum in progress

    def invites(self, silo_id: str) -> bool:
        return silo_id in self.participants or silo_id in self.disclosers


class RoundEngine:
    def __init__(
        self,
        *,
        config: ConsortiumConfig,
        store: Store,
        method: Method,
        layer: SumLayer,
        sign: Callable[[bytes], bytes],
        recorder: RunRecorder | None,
        peers: Peers | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.store = store
        self.method = method
        self.layer = layer
        self.sign = sign
        self.recorder = recorder
        self.peers = peers
        self.secure = config.consortium.privacy == "secagg"
        if self.secure and peers is None:
            raise ValueError("a secagg consortium needs peers to check the silos' signatures")
        self.echo = echo
        self.plan_toml = config.plan.to_toml()
        self.plan_sha256 = config.plan.sha256()
        # evaluation is reporting: it may run beside the next round, so it has a method instance of its own
        self._evaluator = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluation")
        self._eval_method = config.plan.build_method() if recorder is not None else None
        self._lock = threading.Condition()
        self._sessions: dict[str, Session] = {}
        self._last_contributed: dict[str, int] = {}
        self._let_down: set[str] = set()  # invited to train in an aborted attempt of this round, gave nothing
        self.attempt: Attempt | None = None
        self.failure: Exception | None = None
        self.stage = Stage.GATHERING
        self.state = self._load_state()
        self._state_bytes = pack_state(self.state)
        self.picker = RoundPicker(config.plan.selection, config.consortium.seed, store, method)
        if recorder is not None and self.state.round > len(recorder.rounds) and self.state.round > 0:
            self._evaluator.submit(self._report, self.state, None, None)

    # --- start-up ---------------------------------------------------------------------------------

    def _load_state(self) -> GlobalState:
        self.store.bind(self.config.fingerprint())
        latest = self.store.latest_state()
        if latest is None:
            state = self.method.init_state(seed=self.config.consortium.seed)
            self.store.save_initial_state(state.digest(), pack_state(state))
            return state
        state = unpack_state(latest.data, latest.round)
        if state.digest() != latest.digest:
            raise StoreError(f"stored state of round {latest.round} does not match its digest")
        abandoned = self.store.abandon_open_attempts("aggregator restarted")
        if abandoned:
            log.warning("abandoned attempts left open by a restart: %s", ", ".join(abandoned))
        return state

    @property
    def total_rounds(self) -> int:
        """Committed rounds plus those the method still needs (training rounds, then any closing phase)."""
        return self.state.round + self.method.remaining_rounds(self.state)

    # --- called by the service --------------------------------------------------------------------

    def connect(self, silo_id: str) -> Session:
        with self._lock:
            old = self._sessions.get(silo_id)
            if old is not None:
                old.closed = True
                old.directives.put(None)
            session = self._sessions[silo_id] = Session(silo_id)
            if self.stage == Stage.FINISHED:
                session.directives.put(self._finished())
            elif self.attempt is not None and self.attempt.invites(silo_id):
                session.directives.put(pb.JoinResponse(round_spec=self.attempt.signed))
            self._lock.notify_all()
            return session

    def disconnect(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            if self._sessions.get(session.silo_id) is session:
                del self._sessions[session.silo_id]
            self._lock.notify_all()

    def heartbeat(self, silo_id: str, activity: str) -> None:
        with self._lock:
            session = self._sessions.get(silo_id)
            if session is not None:
                session.activity = activity
                session.last_seen_ms = now_ms()

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

    def expected_bytes(self, silo_id: str, round_id: str, purpose: str = "") -> int:
        with self._lock:
            attempt = self._invited(silo_id, round_id)
            if not self.secure:
                return attempt.schema.size * 8
            return self._secure_sum_of(attempt, purpose).spec.words * 8

    def secagg(
        self, silo_id: str, round_id: str, purpose: str, action: Callable[[SecAggServer], None]
    ) -> None:
        """Hand one silo's secure-aggregation message to the session in progress."""
        if not self.secure:
            privacy = self.config.consortium.privacy
            raise WrongRound(
                f"this consortium's rounds use the {privacy!r} layer, which has no secure-sum stages"
            )
        with self._lock:
            action(self._secure_sum_of(self._invited(silo_id, round_id), purpose))
            self._lock.notify_all()

    def submit_masked(self, silo_id: str, round_id: str, purpose: str, payload: bytes, digest: str) -> str:
        words = np.frombuffer(payload, dtype="<u8").astype(np.uint64, copy=False)
        self.secagg(silo_id, round_id, purpose, lambda server: server.add_masked(silo_id, words))
        if purpose == "contribution":
            self._last_contributed[silo_id] = self._invited(silo_id, round_id).round
            self.store.record_contribution(round_id, silo_id, digest)
        return digest

    def _secure_sum_of(self, attempt: Attempt, purpose: str) -> SecAggServer:
        server = attempt.secure
        if server is None or server.spec.purpose != purpose:
            now = f"the {server.spec.purpose} sum" if server else "no secure sum"
            raise WrongRound(f"{attempt.round_id} is running {now}, not the {purpose or 'plaintext'} one")
        return server

    def submit(self, silo_id: str, round_id: str, payload: bytes, digest: str) -> str:
        """Check and keep one silo's plaintext contribution, whose SHA-256 the caller has checked."""
        with self._lock:
            attempt = self._invited(silo_id, round_id)
            if self.secure:
                raise WrongRound(f"this consortium's rounds are secure sums; {round_id} takes masked inputs")
            if silo_id in attempt.receipts:
                if attempt.receipts[silo_id] == digest:
                    return digest
                raise AlreadySubmitted(f"{silo_id} already submitted a different contribution for {round_id}")
            if self.stage != Stage.COLLECTING:
                raise WrongRound(f"attempt {round_id} no longer takes contributions ({self.stage})")
            contribution = _decode(attempt.schema, payload)
            attempt.submissions[silo_id] = contribution
            attempt.receipts[silo_id] = digest
            self._last_contributed[silo_id] = attempt.round
            self._lock.notify_all()
        self.store.record_contribution(round_id, silo_id, digest)
        return digest

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
            silos = self.store.silos()
            server = attempt.secure if attempt else None
            return {
                "committed_rounds": self.state.round,
                "stage": f"{self.stage}: {server.spec.purpose} sum, {server.stage}"
                if server
                else str(self.stage),
                "round_id": attempt.round_id if attempt else "",
                "deadline_ms": attempt.deadline_ms if attempt else 0,
                "participants": list(attempt.participants) if attempt else [],
                "submitted": sorted(server.answered if server else attempt.submissions) if attempt else [],
                "state_digest": self.state.digest(),
                "silos": [
                    {
                        "silo_id": s,
                        "connected": s in self._sessions,
                        "last_seen_unix_ms": self._sessions[s].last_seen_ms if s in self._sessions else seen,
                        "activity": self._sessions[s].activity if s in self._sessions else "offline",
                        "last_contributed_round": self._last_contributed.get(s, 0),
                    }
                    for s, seen in silos.items()
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
            self._evaluator.shutdown(wait=True)

    def _run(self, stop: threading.Event) -> None:
        while self.state.round < self.total_rounds and not stop.is_set():
            connected = self._gather(stop)
            if connected is None:
                break
            picked = self.picker.pick(self.state, self.state.round + 1, connected, avoid=self._let_down)
            attempt = self._start_attempt(*picked)
            try:
                summed = self._secure_sum(attempt, stop) if self.secure else self._plain_sum(attempt, stop)
                if summed is None:
                    self._abort(attempt, "aggregator stopping")
                    break
                self._await_disclosures(attempt, stop)
                self._commit(attempt, *summed)
            except OverflowRisk as exc:
                self._abort(attempt, str(exc))
                raise  # the same round would overflow again: the operator must change the settings
            except SecAggError as exc:
                self._abort(attempt, f"secure aggregation stopped: {exc}")
            except FedltError as exc:
                self._abort(attempt, f"the round failed: {exc}")
        with self._lock:
            if self.state.round >= self.total_rounds:
                self.stage = Stage.FINISHED
                for session in self._sessions.values():
                    session.directives.put(self._finished())
            self.attempt = None
            self._lock.notify_all()

    def _gather(self, stop: threading.Event) -> list[str] | None:
        """Wait for `min_silos` connections, then up to `gather` seconds for every registered silo.

        Before the first round is committed, silos may still be starting and registering, so the whole
        gather window is waited rather than ending when the silos registered so far are all connected.
        """
        minimum = self.config.consortium.min_silos
        with self._lock:
            self.stage = Stage.GATHERING
            while not stop.is_set():
                if not self._wait(stop, lambda: len(self._sessions) >= minimum):
                    return None
                until = time.monotonic() + self.config.timeouts.gather
                everyone = lambda: self.state.round > 0 and set(self.store.silos()) <= set(self._sessions)  # noqa: E731
                self._wait(stop, everyone, until=until)
                if len(self._sessions) >= minimum:
                    return sorted(self._sessions)
            return None

    def _await_disclosures(self, attempt: Attempt, stop: threading.Event) -> None:
        """Give connected disclosers up to `timeouts.stage` more: the next round is picked from them."""
        until = time.monotonic() + self.config.timeouts.stage
        with self._lock:
            self._wait(
                stop,
                lambda: all(s in attempt.disclosed or s not in self._sessions for s in attempt.disclosers),
                until=until,
            )

    def _plain_sum(self, attempt: Attempt, stop: threading.Event) -> tuple[Sums, list[str]] | None:
        contributors = self._collect(attempt, stop)
        if contributors is None:
            return None
        self._require_minimum(contributors)
        return self.layer.aggregate(
            attempt.schema, [attempt.submissions[s] for s in contributors]
        ), contributors

    def _phase(self, schema: Schema) -> str:
        consortium = self.config.consortium
        return tail_guard.phase_key(consortium.id, self.plan_sha256, consortium.seed, schema.phase)

    def _require_minimum(self, contributors: list[str] | tuple[str, ...]) -> None:
        if len(contributors) < self.config.consortium.min_silos:
            raise RoundFailed(f"{len(contributors)} contributions, fewer than min_silos")

    def _start_attempt(self, participants: list[str], disclosers: list[str] | None = None) -> Attempt:
        disclosers = disclosers or []
        round_number = self.state.round + 1
        attempt_number, round_id = self.store.begin_attempt(round_number, participants, secrets.token_hex(4))
        schema = self.method.schema(self.state)
        state_bytes = self._state_bytes
        deadline = now_ms() + int(1000 * self.config.timeouts.round)
        census = self.store.census(self._phase(schema)) if self._guarded(schema) else None
        spec = round_pb2.RoundSpec(
            consortium_id=self.config.consortium.id,
            round=round_number,
            attempt=attempt_number,
            round_id=round_id,
            method=self.config.plan.method.name,
            schema=round_pb2.Schema(
                phase=schema.phase,
                fields=[
                    round_pb2.FieldSpec(
                        name=f.name,
                        shape=f.shape,
                        bound=f.bound,
                        frac_bits=f.frac_bits,
                        per_class=f.per_class,
                    )
                    for f in schema.fields
                ],
            ),
            method_config=self.plan_toml,
            config_sha256=self.plan_sha256,
            state_digest=self.state.digest(),
            state_bytes=len(state_bytes),
            seed=self.config.consortium.seed,
            privacy=self.config.consortium.privacy,
            participants=participants,
            disclosures=[DISCLOSURE] if disclosers else [],
            disclosers=disclosers,
            deadline_unix_ms=deadline,
            secagg=round_pb2.SecAggParameters(**asdict(self.config.secagg)) if self.secure else None,
            census=None
            if census is None
            else round_pb2.Census(silos=census.silos, silos_per_class=census.counts),
        )
        blob = spec.SerializeToString()
        signed = round_pb2.SignedRoundSpec(spec=blob, signature=self.sign(blob))
        attempt = Attempt(
            round_number,
            round_id,
            signed,
            schema,
            participants,
            deadline,
            state_bytes,
            disclosers=disclosers,
            census=census,
        )
        if self.secure:
            census_due = self._guarded(schema) and census is None
            self._open_sum(attempt, "census" if census_due else "contribution", participants, census)
        with self._lock:
            self.attempt = attempt
            self.stage = Stage.COLLECTING
            for silo in sorted({*participants, *disclosers}):
                if silo in self._sessions:
                    self._sessions[silo].directives.put(pb.JoinResponse(round_spec=signed))
        log.debug("round %d: attempt %s with %s", round_number, round_id, ", ".join(participants))
        return attempt

    def _guarded(self, schema: Schema) -> bool:
        return self.secure and bool(schema.classes) and self.config.secagg.k_min >= 2

    def _open_sum(self, attempt: Attempt, purpose: str, silos: list[str], census: Census | None) -> None:
        """Set up the attempt's next secure sum; the first one before the RoundSpec goes out, so no silo's
        first message can arrive before the session that takes it."""
        spec_hash = hashlib.sha256(attempt.signed.spec).digest()
        if purpose == "census":
            words, binding = attempt.schema.classes, spec_hash
        else:
            words = attempt.schema.size
            binding = census.binding(spec_hash) if self._guarded(attempt.schema) else spec_hash
        spec = self.config.secagg.session(attempt.round_id, purpose, silos, words, binding)
        with self._lock:
            attempt.secure = SecAggServer(spec, peers=self.peers)

    def _secure_sum(self, attempt: Attempt, stop: threading.Event) -> tuple[Sums, list[str]] | None:
        """The phase's census (when the tail guard applies and the phase has none yet), then the contribution.

        Per-class rows are released only by silos of the census set, and only in a sum over exactly that set
        (`privacy.secagg.tail_guard`); the silos enforce it, the aggregator only avoids waiting for a sum
        they will refuse to sign.
        """
        schema, k_min = attempt.schema, self.config.secagg.k_min
        codec = FixedPointCodec(schema, max_silos=len(attempt.participants))  # refuses an overflow first
        silos, census = attempt.participants, attempt.census
        census_due = attempt.secure.spec.purpose == "census"
        if census_due:
            taken = self._session(attempt, stop, first=True)
            if taken is None:
                return None
            counts, counted = taken
            census = Census.of(counted, counts)
            self.store.save_census(self._phase(schema), census)
            self._send(counted, attempt, "census", census=pb.CensusResult(silos_per_class=counts.tolist()))
            silos = list(counted)
            self._open_sum(attempt, "contribution", silos, census)
        whole: tuple[str, ...] = ()
        if self._guarded(schema):
            whole = census.silos if tuple(sorted(silos)) == census.silos else ()
            zeroed = census.guarded(silos, k_min)
            self.store.audit("tail_guard", {"round_id": attempt.round_id, "k_min": k_min, "zeroed": zeroed})
            if zeroed:
                log.info("round %d: tail guard zeroes classes %s", attempt.round, zeroed)
        summed = self._session(attempt, stop, first=not census_due, whole=whole)
        if summed is None:
            return None
        total, contributors = summed
        return self.layer.seal(schema, codec.decode(total), len(contributors)), list(contributors)

    def _session(
        self, attempt: Attempt, stop: threading.Event, *, first: bool, whole: tuple[str, ...] = ()
    ) -> tuple[np.ndarray, tuple[str, ...]] | None:
        """The attempt's open secure sum through its five stages; None if the aggregator is stopping.

        `first`: the round's first sum, whose first stage waits for training, until the round's deadline.
        `whole`: the census set, when this sum carries per-class rows; silos sign it only if none of it left.
        """
        server = attempt.secure
        purpose = server.spec.purpose
        if not self._await_stage(server, attempt.deadline_ms if first else None, stop):
            return None
        keys = pb.KeyList(keys=[wire.keys_to_pb(k) for k in self._close(server.close_keys)])
        self._send(server.u1, attempt, purpose, keys=keys)
        if not self._await_stage(server, None, stop):
            return None
        for silo, inbox in self._close(server.close_shares).items():
            self._send([silo], attempt, purpose, inbox=wire.inbox_to_pb(inbox))
        if not self._await_stage(server, None, stop):
            return None
        survivors = self._close(server.close_masked)
        if purpose == "contribution":
            self._require_minimum(survivors)
        if whole and survivors != whole:
            gone = ", ".join(sorted(set(whole) - set(survivors)))
            raise RoundFailed(
                f"{gone} left a sum of per-class rows, which silos sign only over the whole census"
            )
        self._send(survivors, attempt, purpose, survivors=pb.SurvivorList(survivors=survivors))
        if not self._await_stage(server, None, stop):
            return None
        signatures = self._close(server.close_consistency)
        self._send(server.u4, attempt, purpose, signatures=wire.signatures_to_pb(signatures))
        if not self._await_stage(server, None, stop):
            return None
        return self._close(server.close_unmask), survivors

    def _close(self, close: Callable[[], _T]) -> _T:
        with self._lock:
            return close()

    def _await_stage(self, server: SecAggServer, deadline_ms: int | None, stop: threading.Event) -> bool:
        """Wait until everyone expected has answered, the rest are disconnected, or the deadline passes."""
        if deadline_ms is None:
            deadline_ms = now_ms() + int(1000 * self.config.timeouts.stage)

        def answered() -> bool:
            pending = set(server.expected) - server.answered
            return not pending & set(self._sessions)

        with self._lock:
            self._wait(stop, answered, until=time.monotonic() + max(0.0, (deadline_ms - now_ms()) / 1000))
            return not stop.is_set()

    def _send(self, silos: Iterable[str], attempt: Attempt, purpose: str, **step: object) -> None:
        message = pb.SecAggStep(round_id=attempt.round_id, sum=wire.SUM_OF_PURPOSE[purpose], **step)
        with self._lock:
            for silo in silos:
                if silo in self._sessions:
                    self._sessions[silo].directives.put(pb.JoinResponse(secagg_step=message))

    def _collect(self, attempt: Attempt, stop: threading.Event) -> list[str] | None:
        minimum = self.config.consortium.min_silos

        def answered() -> bool:
            pending = [s for s in attempt.participants if s not in attempt.submissions]
            connected_pending = [s for s in pending if s in self._sessions]
            return not pending or (not connected_pending and len(attempt.submissions) >= minimum)

        with self._lock:
            until = time.monotonic() + max(0.0, (attempt.deadline_ms - now_ms()) / 1000)
            self._wait(stop, answered, until=until)
            if stop.is_set():
                return None
            self.stage = Stage.COMMITTING
            return sorted(attempt.submissions)

    def _commit(self, attempt: Attempt, sums: Sums, contributors: list[str]) -> None:
        timer = _Stopwatch()
        state = self.method.server_step(
            self.state, sums, ServerContext(attempt.round, self.config.consortium.seed)
        )
        timer.lap("server step")
        trained = self.method.trains(self.state)
        with self._lock:  # a late disclosure may still arrive: commit one consistent set
            disclosed = dict(attempt.disclosed)
        packed = pack_state(state)
        self.store.commit_round(
            round_number=attempt.round,
            round_id=attempt.round_id,
            digest=state.digest(),
            data=packed,
            contributors=contributors,
            picked=attempt.participants if trained else None,
            disclosures={silo: (DISCLOSURE, values) for silo, values in disclosed.items()},
        )
        if trained:
            self.picker.committed(attempt.round, attempt.participants, disclosed)
        timer.lap("commit")
        with self._lock:
            self.state, self._state_bytes = state, packed
            self.attempt = None
            self._let_down.clear()
        seconds = round(time.perf_counter() - attempt.started, 3)
        log.debug("round %d committed: %s", attempt.round, timer)
        if self.recorder is None:
            self.echo(f"round {attempt.round:>4}/{self.total_rounds} committed, {len(contributors)} silos")
        elif self.config.evaluation.background:
            self._evaluator.submit(self._report, state, contributors, seconds)
        else:
            self._report(state, contributors, seconds)

    def _report(self, state: GlobalState, contributors: list[str] | None, seconds: float | None) -> None:
        """Evaluate a committed state on the operator's evaluation set and keep the result."""
        try:
            entry = self.recorder.evaluate(
                state.round,
                self._eval_method.eval_model(state),
                contributors=contributors,
                state_digest=state.digest(),
            )
            entry["seconds"] = seconds
            self.store.save_metrics(state.round, entry)
            self.recorder.append(entry)
            silos = f"  [{len(contributors)} silos]" if contributors else ""
            self.echo(round_line(entry, self.total_rounds) + silos)
        except Exception:
            log.exception("evaluating round %d failed; training goes on", state.round)

    def _abort(self, attempt: Attempt, reason: str) -> None:
        self.store.abort_attempt(attempt.round_id, reason)
        with self._lock:
            self._let_down.update(
                s for s in attempt.participants if self._last_contributed.get(s) != attempt.round
            )
            for silo in sorted({*attempt.participants, *attempt.disclosers}):
                if silo in self._sessions:
                    abort = pb.Abort(round_id=attempt.round_id, reason=reason)
                    self._sessions[silo].directives.put(pb.JoinResponse(abort=abort))
            self.attempt = None
        log.warning("round %d: attempt %s aborted: %s", attempt.round, attempt.round_id, reason)

    def _finished(self) -> pb.JoinResponse:
        return pb.JoinResponse(
            finished=pb.Finished(rounds=self.state.round, state_digest=self.state.digest())
        )

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


def _decode(schema: Schema, payload: bytes) -> Contribution:
    if len(payload) != schema.size * 8:
        raise BadContribution(f"contribution has {len(payload)} bytes; the schema needs {schema.size * 8}")
    vector = torch.from_numpy(np.frombuffer(payload, dtype="<f8").copy())
    try:
        return schema.contribution(**schema.unflatten(vector))
    except ContributionError as exc:
        raise BadContribution(str(exc)) from None
