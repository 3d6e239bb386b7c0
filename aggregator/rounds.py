"""The round driver: gather silos, publish a signed RoundSpec, drive the round's sums, commit.

Transport-free: one driver thread runs the rounds; what silos send reaches it through the inbox
(`aggregator.inbox`), which the gRPC service calls under the round table's one lock (`aggregator.round_table`)
and which notifies that lock's Condition, on which the driver waits. Directives go out through `Sessions`,
which knows their Protobuf form (the RoundSpec itself is signed bytes, built by `privacy.roundspec`).

Stages of an attempt: GATHERING (waiting for at least `min_silos` connected silos), COLLECTING (RoundSpec out,
then the round's sums stage by stage: `fedlt.aggregation.round_sums.AggregatorRound` over the configured
layer's aggregator half, census and tail guard included, the census kept by `aggregator.rounds`), then the
server step and the commit (`aggregator.committing`). Each stage of a sum ends when every silo expected has
answered, the rest have disconnected or refused the attempt (`RoundInbox.refuse`), or its deadline passes (the
round's first stage waits for training, until the round's deadline; later ones `timeouts.stage`); refusals
that leave the attempt short of its floor end it at once. A sum that cannot complete aborts the attempt, and
the round is tried again; a round is never committed on a partial set below the minimum. Which layer carries
the sums is the layer's business: nothing here looks at its name.

With held-out evaluation (`fedlt.aggregation.evaluation_block`) every round's contribution also carries the
silos' per-class counts on their held-out data for the state the round starts from: stripped from the sum
before the server step and recorded, once the round commits, as that state's metrics. After the last round one
more round carries the counts alone, for the last state; it commits no state (no attempt in the store, an
audit record instead) and the run is finished only once it has run.

`CensusKeeper`: the census the aggregator keeps for each phase of the plan, when it must be taken again, and
what the tail guard held back.

With the tail guard (`fedlt.aggregation.tail_guard`) a round's RoundSpec names the census kept for its phase,
so silos sum only classes that at least `k_min` silos hold. A silo keeps a census only once it computed it,
and takes no other on trust: when silos seem not to hold the kept one, the next attempt names none and takes
the census again over the kept census's silos (`doubt`). Once a guarded sum is released, the classes the
guard zeroed go to the audit log (`released`), which names no silo.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection

from aggregator.committing import RoundCommitter
from aggregator.config import ConsortiumConfig
from aggregator.evaluation import Evaluator
from aggregator.held_state import HeldState
from aggregator.inbox import RoundInbox
from aggregator.picking import RoundPicker
from aggregator.round_table import Attempt, AttemptRefused, RoundTable, Stage
from aggregator.store import Store, StoreError, now_ms
from fedlt.aggregation import Schema, SumLayer, Sums, evaluation_block, tail_guard
from fedlt.aggregation.halves import AggregatorSide, Released, SettingsRefused
from fedlt.aggregation.round_sums import AggregatorRound
from fedlt.aggregation.tail_guard import Census
from fedlt.errors import FedltError
from fedlt.methods import Method
from fedlt.recorder import RunRecorder
from fedlt.selection import DISCLOSURE
from privacy import roundspec

log = logging.getLogger("aggregator")


class CensusKeeper:
    """`plan_sha256`: the plan's digest, part of every phase's key (another plan is another census)."""

    def __init__(self, config: ConsortiumConfig, plan_sha256: str, store: Store) -> None:
        self.config, self.plan_sha256, self.store = config, plan_sha256, store
        # silos that never computed the kept census refuse RoundSpecs naming it: take it again over its silos
        self.doubted = False

    def phase(self, schema: Schema) -> str:
        consortium = self.config.consortium
        return tail_guard.phase_key(consortium.id, self.plan_sha256, consortium.seed, schema.phase)

    def kept(self, schema: Schema) -> Census | None:
        return self.store.census(self.phase(schema))

    def named(self, schema: Schema) -> Census | None:
        """The census a RoundSpec names: the one kept for the phase, unless silos seem not to hold it."""
        return None if self.doubted else self.kept(schema)

    def keep(self, schema: Schema, census: Census) -> None:
        """A census a sum has just taken, kept at once: silos sign one census a set."""
        self.store.save_census(self.phase(schema), census)
        self.doubted = False

    def released(self, attempt: Attempt, counted: Collection[str]) -> None:
        """The contribution sum is released over `counted`: audit what the tail guard held back, and doubt the
        census if its silos were not all counted."""
        sums = attempt.sums
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
        self.doubt(attempt, counted)

    def doubt(self, attempt: Attempt, counted: Collection[str]) -> None:
        """A silo keeps a census only once it computed it, and takes no other on trust: when an attempt naming
        the census fails, or every census silo was invited but some sent nothing, the next attempt takes the
        census again over its silos (which they allow: the same silos, the same presence)."""
        named = attempt.sums.sums.census
        if (
            named is not None
            and set(named.silos) <= set(attempt.participants)
            and set(counted) != set(named.silos)
        ):
            self.doubted = True
            log.warning(
                "round %d: census silos %s did not all take part; the census is taken again over them",
                attempt.round,
                ", ".join(sorted(set(named.silos) - set(counted))),
            )


class RoundDriver:
    """`layer` is the simulator's facade of the configured privacy layer (its name and settings); `side` its
    aggregator half-maker, with the consortium's keys; `roster` the silo ids the roster in force names (None:
    no roster, only the silos registered so far are known). The service is handed `inbox`; `table` is what
    both share."""

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
        self.store = store
        self.layer, self.side = layer, side
        self.sign = sign
        self.plan_toml = config.plan.to_toml()
        self.failure: Exception | None = None
        # what silos are told of the attempt in flight when the driver is stopped
        self.stop_reason = "aggregator stopping"
        self.table = RoundTable(
            config=config,
            store=store,
            held=_held_at_start(config, store, method),
            eligible=side.eligible,
            roster=roster,
        )
        self._evaluation_attempts = 0  # evaluation-only rounds begun
        self.census = CensusKeeper(config, config.plan.sha256(), store)
        self.picker = RoundPicker(config.plan.selection, config.consortium.seed, store, method)
        self.evaluator = Evaluator(
            recorder=recorder,
            # evaluation may run beside the next round, so it has a method instance of its own; none where
            # only counts the silos summed arrive
            method=None if recorder is None or recorder.test is None else config.plan.build_method(),
            store=store,
            background=config.evaluation.background,
            echo=echo,
            total_rounds=lambda: self.table.total_rounds,
        )
        if self.table.held.model is not None:
            self.evaluator.catch_up(self.table.held.model)
        self.committer = RoundCommitter(
            self.table,
            config=config,
            method=method,
            layer=layer,
            side=side,
            picker=self.picker,
            evaluator=self.evaluator,
        )
        self.inbox = RoundInbox(self.table, picker=self.picker, evaluator=self.evaluator)

    @property
    def recorder(self) -> RunRecorder | None:
        return self.evaluator.recorder

    def _trains(self) -> bool:
        """Whether the coming round trains (else it wants every silo: a closing or evaluation-only round)."""
        return self.table.held.trains and self.table.held.round < self.table.total_rounds

    def _round_schema(self) -> Schema:
        """What the coming round sums: the method's fields, and the evaluation block with held-out
        evaluation (the silos derive the same from the state and the signed plan)."""
        held = self.table.held
        return self.config.plan.round_schema(held.schema, starting_round=held.round, remaining=held.remaining)

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
        table = self.table
        while self.committer.round_due() and not stop.is_set():
            connected = self._gather(stop)
            if connected is None:
                break
            round_number = table.held.round + 1
            pinned = self._pinned(round_number, stop)
            if pinned is None:
                break
            picked = (
                (pinned, [])
                if pinned
                else self.picker.pick(self._trains(), round_number, connected, avoid=table.let_down)
            )
            attempt = self._start_attempt(*picked)
            self.store.checkpoint()  # while silos train: off the path between a commit and its RoundSpec
            try:
                summed = self._sums(attempt, stop)
                if summed is not None:
                    self._await_disclosures(attempt, stop)
                    held = self.committer.next_state(attempt, summed, stop)
                if summed is None or held is None:
                    self._abort(attempt, self.stop_reason)
                    break
                self.committer.commit(attempt, held)
            except SettingsRefused as exc:
                self._abort(attempt, str(exc))
                raise  # the same round would overflow again: the operator must change the settings
            except FedltError as exc:
                self._abort(attempt, f"the round failed: {exc}")
        with table.lock:
            # the last round's evaluation, where silos compute it, before they are told the run is over
            until = time.monotonic() + self.config.timeouts.stage
            table.wait(stop, table.evaluations_in, until=until)
            if not self.committer.round_due():
                table.stage = Stage.FINISHED
                table.sessions.finished(table.sessions.connected(), table.held.round, table.held.digest)
            table.attempt = None
            table.lock.notify_all()

    def _gather(self, stop: threading.Event) -> list[str] | None:
        """Wait for `min_silos` connections, then up to `gather` seconds for the rest (`everyone_ready`)."""
        table, minimum = self.table, self.config.consortium.min_silos
        with table.lock:
            table.stage = Stage.GATHERING
            while not stop.is_set():
                if not table.wait(stop, lambda: len(table.ready()) >= minimum):
                    return None
                until = time.monotonic() + self.config.timeouts.gather
                table.wait(stop, table.everyone_ready, until=until)
                if len(table.ready()) >= minimum:
                    return table.ready()
            return None

    def _pinned(self, round_number: int, stop: threading.Event) -> list[str] | None:
        """The silos an earlier attempt of this round asked to release a sum for, once every one of them is
        connected: they refuse to release it for any other set (`silo.releases`), so the round can only be
        retried over exactly them. The contribution sum's set, or the census's while its phase has none kept
        (or the kept census's, while it is to be taken again); [] if no attempt got that far; None if
        stopping."""
        table = self.table
        pins = self.store.pinned_releases(round_number)
        kept = self.census.kept(self._round_schema())
        retaken = list(kept.silos) if kept is not None and self.census.doubted else None
        silos = pins.get("contribution") or (pins.get("census") if kept is None else retaken)
        if not silos:
            return []
        with table.lock:
            missing = sorted(set(silos) - set(table.ready()))
            if missing:
                log.warning(
                    "round %d waits for %s: %s were asked to release it and release it for no other set",
                    round_number,
                    ", ".join(missing),
                    ", ".join(silos),
                )
            if not table.wait(stop, lambda: set(silos) <= set(table.ready())):
                return None
        return silos

    def _start_attempt(self, participants: list[str], disclosers: list[str] | None = None) -> Attempt:
        """Sign the RoundSpec and open the round's first sum before the RoundSpec goes out, so no silo's first
        message can arrive before the sum that takes it."""
        disclosers = disclosers or []
        held = self.table.held
        round_number = held.round + 1
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
            state_digest=held.digest,
            state_bytes=len(held.blob),
            seed=self.config.consortium.seed,
            privacy=self.layer.name,
            settings=self.side.round_settings(self.layer.settings),
            participants=participants,
            disclosures=[DISCLOSURE] if disclosers else [],
            disclosers=disclosers,
            deadline_unix_ms=deadline,
            census=self.census.named(schema) if guarded else None,
            attested=held.attested,
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
            held.blob,
            sums,
            disclosers=disclosers,
        )
        with self.table.lock:
            self.table.attempt = attempt
            self.table.stage = Stage.COLLECTING
            self.table.sessions.round_spec(sorted({*participants, *disclosers}), signed)
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
            with self.table.lock:
                out = sums.close()
            if sums.census_taken is not None and taken is None:
                self.census.keep(attempt.schema, sums.census_taken)
            if isinstance(out, Released):
                break
            if sums.half.counted is not None and sums.purpose not in pinned:
                # the steps out ask silos to release the sum for this set: kept first, once a sum
                self.store.pin_release(attempt.round, sums.purpose, sums.half.counted)
                pinned.add(sums.purpose)
            for silo, purpose, step in out:
                self.table.sessions.step(silo, attempt.round_id, purpose, step)
        self.census.released(attempt, out.survivors)
        with self.table.lock:
            attempt.contributors, attempt.readers = out.survivors, out.stepping
            self.table.stage = Stage.COMMITTING
        return out if out.total is None else self.committer.stripped(attempt, out)

    def _await_stage(self, attempt: Attempt, deadline_ms: int, stop: threading.Event) -> bool:
        """Wait until everyone expected has answered, refused or disconnected, or the deadline passes; a
        refusal that leaves the attempt short of its floor ends it at once (AttemptRefused)."""
        table, sums = self.table, attempt.sums

        def answered() -> bool:
            done = table.all_in(sums.half.expected, {*sums.half.answered, *attempt.refused})
            return done or bool(table.short_of_floor(attempt))

        with table.lock:
            table.wait(stop, answered, until=time.monotonic() + max(0.0, (deadline_ms - now_ms()) / 1000))
            if stop.is_set():
                return False
            short = table.short_of_floor(attempt)
        if short:
            raise AttemptRefused(short)
        return True

    def _await_disclosures(self, attempt: Attempt, stop: threading.Event) -> None:
        """Give connected disclosers up to `timeouts.stage` more: the next round is picked from them."""
        table = self.table
        until = time.monotonic() + self.config.timeouts.stage
        with table.lock:
            table.wait(
                stop,
                lambda: table.all_in(attempt.disclosers, {*attempt.disclosed, *attempt.refused}),
                until=until,
            )

    def _abort(self, attempt: Attempt, reason: str) -> None:
        table = self.table
        self.census.doubt(attempt, ())
        self.store.abort_attempt(attempt.round_id, reason)
        with table.lock:
            table.let_down.update(
                s for s in attempt.participants if table.last_contributed.get(s) != attempt.round
            )
            table.sessions.abort(
                sorted({*attempt.participants, *attempt.disclosers}), attempt.round_id, reason
            )
            table.attempt, table.aborted = None, attempt
        log.warning("round %d: attempt %s aborted: %s", attempt.round, attempt.round_id, reason)


def _held_at_start(config: ConsortiumConfig, store: Store, method: Method) -> HeldState:
    """The state the run goes on from: the last committed one (attempts a restart left open abandoned), or,
    in a new data directory, the method's seeded initial state, stored first."""
    store.bind(config.fingerprint())
    latest = store.latest_state()
    if latest is None:
        held = HeldState.plain(method.init_state(seed=config.consortium.seed), method)
        store.save_initial_state(held.digest, held.stored())
        return held
    try:
        held = HeldState.from_stored(latest.data, latest.round, latest.digest, method)
    except ValueError as exc:
        raise StoreError(str(exc)) from None
    abandoned = store.abandon_open_attempts("aggregator restarted")
    if abandoned:
        log.warning("abandoned attempts left open by a restart: %s", ", ".join(abandoned))
    return held
