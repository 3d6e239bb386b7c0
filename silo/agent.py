"""The silo agent: connect, check every claim the aggregator makes, train, upload; survive restarts.

Trust comes from the silo's pinned roster (`silo.trust`), not from the aggregator: the aggregator's TLS
endpoint and RoundSpec signer must be the roster's aggregator, and every peer the roster's silo of that id.
A newer roster the aggregator offers (at registration, in heartbeat replies, with a RoundSpec) is adopted only
if a quorum signed it; the silo's own certificate, re-read when replaced on disk, is switched to a renewed
one once the roster names it (`silo.trust.OwnCertificate`).
For each RoundSpec the agent verifies the signature, that it is addressed to the roster's consortium and to
this silo, that its method, privacy layer, disclosures and secure-sum parameters meet the silo's policy, that
the plan parses and matches its hash, and that the state it streams matches the signed digest. Only then does
it train. The contribution then leaves through the round's sums (`silo.participation`) over the layer the
RoundSpec names, with this silo's side of that layer (`sides`, one per layer its policy lists, among those it
implements); a RoundSpec naming any other layer is refused, so no layer ever falls back to a plain upload.
Every release passes the silo's one release gate (`fedlt.aggregation.gate`: roster, floors, and the release
ledger keyed by the state trained from), whose ledgers fail closed at start (`silo.releases.check_ledgers`). A
finished contribution is written to disk before upload, keyed by the state it was trained from, so an agent
restarted mid-upload, or handed the same state under another label, sends the same bytes instead of training
again. Where the layer lets only silos read the sum (ckks), the silo also runs the server
step and reports the sealed next state (`silo.stepping`); where it asks for the key service, its keys come
from the key ceremony (`silo.key_service`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from fedlt.aggregation import Schema, evaluation_block, layer_names, make_layer, record, tail_guard
from fedlt.aggregation.gate import Floors, ReleaseGate
from fedlt.aggregation.halves import PartyKeys, SiloHalf
from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.data.arrays import LabeledImages
from fedlt.dir_lock import DirectoryLock
from fedlt.errors import ContributionError, DataError, FedltError
from fedlt.keepalive import silo_options
from fedlt.methods import GlobalState, Method, SiloContext
from fedlt.methods.state import unpack_state
from fedlt.plan import RoundPlan
from fedlt.selection import DISCLOSURE, class_mean_disclosure, mask_stream
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, round_pb2
from fedlt.wire import schema_from_pb
from privacy import roundspec
from privacy.dp import BudgetExceeded, SiloPrivacy
from privacy.peers import ConsortiumPeers
from privacy.pki.errors import PkiError
from privacy.pki.renewal import ExpiryWatch
from privacy.pki.signing import sign
from privacy.roundspec import RoundSpecError
from privacy.wire import drill_name, fetched, step_from_pb, upload_types
from silo.budget import ledger_path, open_ledger
from silo.config import SiloConfig
from silo.export import keep_stepped
from silo.key_service import KeyService
from silo.participation import Participation
from silo.releases import ReleaseLedger, check_ledgers
from silo.stepping import (
    expected_schema,
    opened_state,
    report_evaluation,
    round_contribution,
    step_and_report,
)
from silo.tls_probe import UNTRUSTED, ConnectionProblem, UntrustedAggregator, server_certificate
from silo.trust import Credentials, OwnCertificate, SiloTrust, expiry_watch, switch_due

log = logging.getLogger("silo")

VERSION = "fedlt-silo/0.1"
# Calls other than the directive stream must not hang forever on a silent network.
CALL_TIMEOUT = 120.0


# Dropout drills (operators rehearsing, and the tests): the agent freezes itself right after sending the named
# message (`privacy.wire.drill_name`) of a contribution sum, or of a census sum as "census:<name>", so a
# dropout can be placed at an exact stage.
DRILL = "FEDLT_DRILL_STOP_AFTER"


# What the aggregator is told of a refusal whose message names this silo's own facts (its data, its privacy
# budget): the kind alone. The message stays in the silo's log.
TOLD = {
    pb.REFUSAL_CODE_DATA: "this silo's data does not fit the plan; the silo's log says how",
    pb.REFUSAL_CODE_BUDGET: "the round would spend more of this silo's privacy budget than it has left",
}
TOLD_CHARS = 512  # the aggregator takes one printable line of at most this many characters


class RefusedRound(FedltError):
    """A RoundSpec this silo will not act on (bad signature, policy, plan, data, mismatched state), of the
    kind `code` names (a RefusalCode). `told` is what the aggregator hears: by default the message, which
    speaks of the policy and the plan; for a kind whose message names this silo's own facts (`TOLD`), the
    kind's sentence only. A raiser whose message names local facts under another kind passes its own."""

    def __init__(self, message: str, *, code: int = pb.REFUSAL_CODE_POLICY, told: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.told = told if told is not None else TOLD.get(code, message)


class Fatal(FedltError):
    """A condition retrying cannot fix: refused certificate, wrong consortium, an aggregator this silo's kit
    does not trust; `python -m silo run` exits 2 with its message."""


class SiloAgent:
    def __init__(self, config: SiloConfig, *, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.state_dir = config.path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # one agent per state directory, for this process's life: a second would lose the first's records
        self.state_lock = DirectoryLock.take(self.state_dir)
        check_ledgers(self.state_dir, ledger_path(config))  # before anything here is written
        if config.compute.threads:
            torch.set_num_threads(config.compute.threads)
        # this silo's data as its files label it; `self.data` is it in the label space of the plan at hand
        self.local: LabeledImages = config.load_data()
        self.data = self.local
        conn = config.connection
        try:
            self.ca_pem = config.path(conn.ca).read_bytes()
        except OSError as exc:
            raise PkiError(
                f"cannot read the consortium CA certificate {config.path(conn.ca)}: {exc.strerror}"
            ) from None
        # this silo's certificate and key: checked now (an expired one stops the agent, saying so), and
        # watched for a renewed pair installed over them (`_renewal_due`)
        self.own = OwnCertificate(
            config.path(conn.certificate), config.path(conn.key), self.ca_pem, ca_path=config.path(conn.ca)
        )
        self._use(self.own.read())
        self._switch_to: Credentials | None = None
        self._expiry = ExpiryWatch(
            lambda: expiry_watch(self.running, self.own), within_days=conn.renew_within_days, logger=log
        )
        self.trust = SiloTrust(
            self.state_dir,
            ca_pem=self.ca_pem,
            kit_roster=config.path(conn.roster),
            crl=config.path(conn.crl) if conn.crl else None,
            quorum_above=config.policy.roster_quorum_above,
        )
        self.ledger = ReleaseLedger(self.state_dir)
        self.gate = ReleaseGate(
            consortium=self.trust.roster.consortium,
            floors=Floors(config.policy.min_participants, config.policy.min_survivors),
            members=lambda: self.trust.roster.silo_ids,
            ledger=self.ledger,
        )
        self.silo_id = ""
        self.aggregator_pem = b""
        self.activity = pb.SILO_ACTIVITY_IDLE
        self.round_id = ""
        self._method: tuple[str, Method] | None = None
        self._privacy: tuple[str, SiloPrivacy] | None = None
        self.privacy_ledger = open_ledger(config)  # one per silo, across plans; read once, then kept in step
        self.privacy_ledger.keep()
        self.ledger.note_privacy_ledger()
        self._expiry_warnings()
        # the key service, for each layer the policy lists that asks for one
        self.keys = KeyService(
            self.state_dir, config.policy.privacy, trust=self.trust, sign=self._sign, timeout=CALL_TIMEOUT
        )
        # held-out data, evaluated inside a sum under whichever layer; in the plan's label space like `data`
        self.local_held_out = config.load_evaluation()
        self.held_out = self.local_held_out
        keys = PartyKeys(
            sign=self._sign,
            peers=ConsortiumPeers(self.trust.members),
        )
        # each layer the policy accepts, as this silo uses it, with its reading of the policy's minimums; a
        # RoundSpec naming another is refused
        self.sides = {
            name: make_layer(name).silo_side(
                replace(keys, policy=_layer_policy(name, config), secret=self.keys.secret_for(name))
            )
            for name in config.policy.privacy
        }
        self._taking_part: Participation | None = None
        # where this silo steps the model: the round's starting state, and the evaluation sum it joined last
        self._stepping: tuple[str, GlobalState, Method] | None = None
        self._evaluating: tuple[round_pb2.RoundSpec, SiloHalf] | None = None

    def _sign(self, data: bytes, *, context: str) -> bytes:
        return sign(self._signing_key, data, context=context)

    # --- this silo's certificate: expiry and renewal ------------------------------------------------

    def _use(self, credentials: Credentials) -> None:
        self.running = credentials
        self.credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=credentials.key_pem,
            certificate_chain=credentials.cert_pem,
        )
        self._signing_key = credentials.key
        self.me = credentials.silo_id

    def _expiry_warnings(self) -> None:
        """At start and at each registration: each warning once a day (its days left change daily)."""
        self._expiry.check()

    def _renewal_due(self) -> bool:
        """Whether the certificate files hold a renewed pair the pinned roster names (checked after each
        heartbeat and roster offered): then this session ends (its stream is cancelled) and the next one
        presents it. Switching only once the roster names it keeps peers holding the roster accepting it."""
        if self._switch_to is None:
            renewed = self.own.renewed(self.running)
            if switch_due(self.trust, self.running, renewed):
                self._switch_to = renewed
        return self._switch_to is not None

    def _switch(self, *, refused: bool) -> bool:
        """Take the renewed certificate for the next session: one found due, or, after the aggregator refused
        the running one, any valid renewed pair on disk (the aggregator's roster may name it already; this
        silo adopts that roster once registered). False if there is none."""
        renewed = self._switch_to or (self.own.renewed(self.running) if refused else None)
        self._switch_to = None
        if renewed is None:
            return False
        log.warning("switching to the renewed certificate (%s); reconnecting", renewed.describe())
        self._use(renewed)
        self._taking_part = None  # its sums are signed under the other certificate: the round is retried
        return True

    # --- the long-running loop ----------------------------------------------------------------

    def run(self) -> int:
        """Keep a session up until the consortium is finished, with jittered exponential backoff; what no
        retry can mend (this silo refused, an aggregator its kit does not trust) raises Fatal."""
        backoff = 1.0
        address = self.config.connection.aggregator
        while not self.stop.is_set():
            try:
                if self._session():
                    return 0
                backoff = 1.0
                if self._switch_to is not None:
                    continue  # the session ended to present the renewed certificate: at once
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break
                code = exc.code()
                refused = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                if self._switch_to is not None or (refused and self._switch(refused=True)):
                    continue
                if refused:
                    raise Fatal(f"the aggregator at {address} refuses this silo: {exc.details()}") from None
                problem = f"a call to the aggregator at {address} failed ({code.name}: {exc.details()})"
                log.warning("connection problem: %s; retrying in %.0f s", problem, backoff)
            except OSError as exc:  # the probe's ConnectionProblem says where and what it likely means
                if self.stop.is_set():
                    break
                problem = exc if isinstance(exc, ConnectionProblem) else f"cannot reach {address}: {exc}"
                log.warning("connection problem: %s; retrying in %.0f s", problem, backoff)
            self.stop.wait(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.config.connection.max_backoff_seconds)
        log.info("stopped on request; progress is kept in %s", self.state_dir)
        return 0

    def _session(self) -> bool:
        if self._switch_to is not None:
            self._switch(refused=False)
        conn = self.config.connection
        options = silo_options(conn.keepalive_seconds)
        if conn.server_name:
            options.append(("grpc.ssl_target_name_override", conn.server_name))
        session_over = threading.Event()
        helpers: list[threading.Thread] = []
        try:
            tls_pem = server_certificate(
                conn.aggregator,
                server_name=conn.server_name,
                ca_pem=self.ca_pem,
                certificate=self.config.path(conn.certificate),
                key=self.config.path(conn.key),
            )
        except UntrustedAggregator as exc:  # this silo's kit or address is wrong: a retry sees the same
            raise Fatal(str(exc)) from None
        try:
            with grpc.secure_channel(conn.aggregator, self.credentials, options=options) as channel:
                stub = consortium_pb2_grpc.ConsortiumServiceStub(channel)
                self._register(stub, tls_pem)
                stream = stub.Join(pb.JoinRequest(last_round=self._progress().get("committed", 0)))
                helpers = [
                    threading.Thread(target=self._heartbeats, args=(stub, session_over), daemon=True),
                    threading.Thread(target=self._cancel_on_stop, args=(stream, session_over), daemon=True),
                ]
                for helper in helpers:
                    helper.start()
                try:
                    return self._follow(stub, stream)
                finally:
                    session_over.set()
                    stream.cancel()
        finally:
            # gRPC's C core can abort the process ("terminate called without an active exception") when
            # the interpreter exits with a call still in flight on a daemon thread: end the helpers first.
            for helper in helpers:
                helper.join(timeout=CALL_TIMEOUT)

    def _follow(self, stub: consortium_pb2_grpc.ConsortiumServiceStub, stream: Iterator) -> bool:
        """Act on directives until the stream ends; True when the consortium is finished."""
        for directive in stream:
            if directive.roster and self.trust.offer_roster(directive.roster) and self._renewal_due():
                return False  # the next session presents the renewed certificate the roster now names
            kind = directive.WhichOneof("directive")
            if kind == "round_spec":
                self._round(stub, directive.round_spec)
            elif kind == "sum_step":
                self._sum_step(stub, directive.sum_step)
            elif kind == "abort":
                log.warning("aggregator aborted %s: %s", directive.abort.round_id, directive.abort.reason)
                if (
                    self._taking_part is not None
                    and self._taking_part.spec.round_id == directive.abort.round_id
                ):
                    self._idle()
            elif kind == "finished":
                done = directive.finished
                log.info(
                    "consortium finished after %d rounds (state %s)", done.rounds, done.state_digest[:16]
                )
                self._save_progress(committed=done.rounds)
                return True
        return False

    def _cancel_on_stop(self, stream: grpc.Future, session_over: threading.Event) -> None:
        while not session_over.wait(0.2):
            if self.stop.is_set() or self._switch_to is not None:
                stream.cancel()
                return

    def _register(self, stub: consortium_pb2_grpc.ConsortiumServiceStub, tls_pem: bytes) -> None:
        """Register, take any newer roster or CRL offered, then check the aggregator against the roster."""
        policy = self.config.policy
        request = pb.RegisterRequest(
            agent_version=VERSION,
            accepted_methods=policy.methods,
            accepted_privacy=policy.privacy,
            accepted_disclosures=policy.disclosures,
            key_enrollment=self.keys.enrollment(self.me),
        )
        try:
            reply = stub.Register(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a retry would send the same again
                raise Fatal(f"the aggregator refuses this silo's registration: {exc.details()}") from None
            raise
        self.trust.offer_crl(reply.crl)  # first: a revocation it carries counts against the roster's signers
        self.trust.offer_roster(reply.roster)
        self._renewal_due()  # says once if the roster names another certificate than the running one
        roster = self.trust.roster
        try:
            if reply.consortium_id != roster.consortium:
                raise PkiError(
                    f"it serves consortium {reply.consortium_id!r}, the roster {roster.consortium!r}"
                )
            tls = self.trust.members.aggregator(tls_pem)
            signer = self.trust.members.aggregator(reply.aggregator_certificate)
            if tls != signer:
                raise PkiError("it signs RoundSpecs with another certificate than it serves TLS with")
        except PkiError as exc:
            raise Fatal(
                f"{UNTRUSTED}: the aggregator at {self.config.connection.aggregator} is not this "
                f"consortium's: {exc}"
            ) from None
        self.aggregator_pem, self.silo_id = reply.aggregator_certificate, reply.silo_id
        log.info("registered as %s with consortium %r", reply.silo_id, reply.consortium_id)
        self._expiry_warnings()
        self.keys.registered(stub, reply)

    def _heartbeat(self) -> pb.HeartbeatRequest:
        """Activity, and the ε left in this silo's budget if (and only if) its dp.report says to tell."""
        request = pb.HeartbeatRequest(
            round_id=self.round_id,
            activity=self.activity,
            roster_sha256=self.trust.roster.digest(),
            crl_sha256=self.trust.crl_sha256,
        )
        if self.config.dp.report:
            request.privacy_remaining = self.privacy_ledger.remaining()
        return request

    def _heartbeats(
        self, stub: consortium_pb2_grpc.ConsortiumServiceStub, session_over: threading.Event
    ) -> None:
        while not session_over.wait(self.config.connection.heartbeat_seconds) and not self.stop.is_set():
            try:
                reply = stub.Heartbeat(self._heartbeat(), timeout=10)
                if reply.crl:  # first: a revocation it carries counts against the roster's signers
                    self.trust.offer_crl(reply.crl)
                self.trust.offer_roster(reply.roster)  # a running silo adopts a newer roster here
                if self._renewal_due():
                    return  # the stream is cancelled; the next session presents the renewed certificate
                self.keys.heartbeat(stub)
            except grpc.RpcError:
                return

    # --- one round ------------------------------------------------------------------------------

    def _round(
        self, stub: consortium_pb2_grpc.ConsortiumServiceStub, signed: round_pb2.SignedRoundSpec
    ) -> None:
        self.keys.before_round(stub, signed, self.aggregator_pem)
        try:
            spec, plan = self._check_spec(signed)
        except RefusedRound as exc:
            self._refuse(stub, _round_id_of(signed), exc)
            return
        except PkiError as exc:  # the signer is not the roster's aggregator, or the signature is not its
            self._refuse(stub, _round_id_of(signed), RefusedRound(str(exc), code=pb.REFUSAL_CODE_SIGNATURE))
            return
        if self._taking_part is not None and self._taking_part.spec.round_id == spec.round_id:
            log.info("%s: still taking part in its sums after a reconnect", spec.round_id)
            taking_part = self._taking_part
            self._sum_call(spec.round_id, lambda: taking_part.resume(stub))
            return
        self.round_id = spec.round_id
        self._taking_part = None
        checked = self._checked_state(stub, spec, plan)
        if checked is None:
            return
        state, method = checked
        trains = self.silo_id in spec.participants
        payload = self._pending(spec, state) if trains else None
        payload = payload or self._work(stub, spec, plan, trains, state, method)
        if payload is None:
            return
        self.activity = pb.SILO_ACTIVITY_UPLOADING  # until its sums end (`_idle`)
        contribution = torch.from_numpy(np.frombuffer(payload, dtype="<f8").copy())

        def start() -> None:
            self._taking_part = Participation(
                signed,
                spec,
                contribution,
                me=self.silo_id,
                side=self.sides[spec.privacy],
                gate=self.gate,
                trained_from=state.content_digest(),
                ledger=self.ledger,
                stub=stub,
                timeout=CALL_TIMEOUT,
                on_sent=lambda purpose, message: self._sent(spec, purpose, message),
                noise=self._privacy_for(plan, spec.config_sha256),
                records=np.bincount(self.data.y, minlength=self.data.num_classes),
                class_names=plan.model.classes,
            )
            self._taking_part.start()

        self._sum_call(spec.round_id, start)

    def _refuse(self, stub, round_id: str, refusal: RefusedRound) -> None:
        """Tell the aggregator that this silo will not take part in `round_id`, so that no stage waits for it
        and the operator sees why: in the words of `refusal.told`, the whole message in this log only. A
        refusal the aggregator does not take (another attempt in flight, the network) is logged, no more."""
        self.activity = pb.SILO_ACTIVITY_IDLE
        log.error("refusing a round: %s", refusal)
        if refusal.code in (pb.REFUSAL_CODE_POLICY, pb.REFUSAL_CODE_DATA):
            log.error("this agent reads silo.toml and its data when it starts: restart it after a change")
        if not round_id:
            return  # a RoundSpec that names no attempt: nothing to tell
        told = _one_line(refusal.told.removeprefix(f"{round_id}: "))  # the aggregator shows the id beside it
        request = pb.RefuseRequest(round_id=round_id, code=refusal.code, text=told)
        try:
            stub.Refuse(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as exc:
            log.warning(
                "%s: the aggregator did not take this refusal (%s: %s)",
                round_id,
                exc.code().name,
                exc.details(),
            )

    def _sum_step(self, stub, step: pb.SumStep) -> None:
        if step.sum == pb.SECURE_SUM_EVALUATION:
            self._sum_call(step.round_id, lambda: self._evaluation_step(stub, step))
            return
        taking_part = self._taking_part
        if taking_part is None or taking_part.spec.round_id != step.round_id:
            log.warning("ignoring a step of %s, whose sums this silo is not in", step.round_id)
            return
        self._sum_call(step.round_id, lambda: taking_part.step(step))
        if taking_part.done:
            self._idle()
            if self.sides[taking_part.spec.privacy].steps_model:
                self._sum_call(step.round_id, lambda: self._step_model(stub, taking_part))

    def _step_model(self, stub, taking_part: Participation) -> None:
        """Only silos can read this round's sum: step the model here and report the sealed next state."""
        spec = taking_part.spec
        if self._stepping is None or self._stepping[0] != spec.round_id:
            log.error("%s: the starting state of the round is not at hand; not stepping", spec.round_id)
            return
        _, state, method = self._stepping
        evaluation, digest = step_and_report(
            stub,
            taking_part,
            side=self.sides[spec.privacy],
            sign=self._sign,
            secret=self.keys.secret(spec),
            state=state,
            method=method,
            held_out=self.held_out,
            gate=self.gate,
            timeout=CALL_TIMEOUT,
            keep=lambda header, sealed: keep_stepped(self.state_dir, spec, taking_part.me, header, sealed),
        )
        self._stepping, self._evaluating = None, (spec, evaluation)
        log.info("round %d: stepped the model to state %s, reported it sealed", spec.round, digest)

    def _evaluation_step(self, stub, step: pb.SumStep) -> None:
        if self._evaluating is None or self._evaluating[0].round_id != step.round_id:
            log.warning("ignoring an evaluation sum of %s, which this silo did not join", step.round_id)
            return
        joined = self._evaluating
        spec, evaluation = joined
        self._evaluating = None
        purpose, announced = step_from_pb(step, layer=spec.privacy)
        summed = fetched(stub, spec.round_id, purpose, announced, timeout=CALL_TIMEOUT)
        if not report_evaluation(stub, spec.round, evaluation, summed, CALL_TIMEOUT):
            self._evaluating = joined  # signed: every silo's signature is next
            return
        log.info("round %d: reported the consortium's evaluation counts", spec.round)

    def _sent(self, spec: round_pb2.RoundSpec, purpose: str, message: object) -> None:
        """After each message: the contribution's upload ends the pending file; drills may stop here."""
        if purpose == "contribution" and type(message) in upload_types():
            self._clear_pending()
            self._save_progress(committed=spec.round - 1, submitted=spec.round_id)
            log.info("round %d: contribution accepted (%s)", spec.round, type(message).__name__)
        drill, name = os.environ.get(DRILL, ""), drill_name(message)
        if drill and name and drill == (name if purpose == "contribution" else f"{purpose}:{name}"):
            log.warning("drill: stopping after sending the %s message, as %s asks", drill, DRILL)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _sum_call(self, round_id: str, action: Callable[[], None]) -> None:
        """Run one stage; a protocol violation or a refused message ends this silo's part in the round."""
        try:
            action()
        except FedltError as exc:
            log.error("%s: leaving the round's sums: %s", round_id, exc)
            self._idle()
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise
            log.warning("%s: the aggregator refused a message: %s", round_id, exc.details())
            self._idle()

    def _idle(self) -> None:
        """This silo's part in a round's sums is over (done, aborted or left): what status shows says so."""
        self._taking_part = None
        self.activity = pb.SILO_ACTIVITY_IDLE

    def _check_spec(self, signed: round_pb2.SignedRoundSpec) -> tuple[round_pb2.RoundSpec, RoundPlan]:
        signer = self.trust.members.aggregator(self.aggregator_pem)  # still valid, not revoked, on the roster
        try:
            spec = roundspec.open_signed(signed, signer)
        except RoundSpecError as exc:
            raise RefusedRound(str(exc)) from None
        policy = self.config.policy
        problems = []
        if spec.consortium_id != self.trust.roster.consortium:
            problems.append(
                f"it is for consortium {spec.consortium_id!r}, not {self.trust.roster.consortium!r}"
            )
        if self.silo_id not in spec.participants and self.silo_id not in spec.disclosers:
            problems.append(f"this silo ({self.silo_id}) is not among the participants")
        if spec.method not in policy.methods:
            problems.append(f"method {spec.method!r} is not allowed by policy.methods")
        if spec.privacy not in layer_names():
            problems.append(f"privacy layer {spec.privacy!r} is not installed with this agent")
        elif spec.privacy not in self.sides:
            problems.append(f"privacy layer {spec.privacy!r} is not allowed by policy.privacy")
        extra = sorted(set(spec.disclosures) - set(policy.disclosures))
        if extra:
            problems.append(f"disclosures {extra} are not allowed by policy.disclosures")
        if hashlib.sha256(spec.method_config.encode()).hexdigest() != spec.config_sha256:
            problems.append("method_config does not match config_sha256")
        if spec.state_bytes > policy.max_state_mb * 2**20:
            problems.append(f"state of {spec.state_bytes} bytes exceeds policy.max_state_mb")
        if spec.privacy in self.sides:
            problems += self._sum_problems(signed, spec)
        if problems:
            raise RefusedRound(f"{spec.round_id}: " + "; ".join(problems))
        try:
            plan = RoundPlan.from_toml(spec.method_config, f"RoundSpec {spec.round_id}")
        except FedltError as exc:
            raise RefusedRound(
                f"{spec.round_id}: its method_config is not a plan this silo can run: {exc}",
                code=pb.REFUSAL_CODE_PLAN,
            ) from None
        if plan.method.name != spec.method:
            raise RefusedRound(
                f"{spec.round_id}: plan runs {plan.method.name!r}, spec says {spec.method!r}",
                code=pb.REFUSAL_CODE_PLAN,
            )
        refused = self.config.dp.problems(plan.dp)
        if self.sides[spec.privacy].hides_inputs:
            sums = roundspec.sums_of(signed, spec)
            accepted = self.config.policy.min_class_records
            refused += tail_guard.inverting_problems(
                sums.schema, sums.record_floor, dp=plan.dp.enabled, accepted=accepted
            )
            refused += tail_guard.floor_problems(sums.record_floor, dp=plan.dp.enabled, accepted=accepted)
        if refused:
            raise RefusedRound(f"{spec.round_id}: " + "; ".join(refused))
        if tuple(plan.model.image_shape) != self.local.image_shape:
            raise RefusedRound(
                f"{spec.round_id}: the model takes {plan.model.image_shape} images; local data is "
                f"{self.local.image_shape}",
                code=pb.REFUSAL_CODE_DATA,
            )
        try:
            self.data = self.local.in_label_space(plan.model.classes)
            if self.local_held_out is not None:
                self.held_out = self.local_held_out.in_label_space(plan.model.classes)
        except DataError as exc:
            raise RefusedRound(f"{spec.round_id}: local data {exc}", code=pb.REFUSAL_CODE_DATA) from None
        return spec, plan

    def _sum_problems(self, signed: round_pb2.SignedRoundSpec, spec: round_pb2.RoundSpec) -> list[str]:
        """The signed parameters of the round's sums against this silo's minimums, before any work."""
        side = self.sides[spec.privacy]
        try:
            sums = roundspec.sums_of(signed, spec)
        except (FedltError, ValueError) as exc:
            return [f"its sums are malformed: {exc}"]
        problems = []
        if side.hides_inputs and sums.k_min < self.config.policy.min_tail_guard:
            problems.append(
                f"tail guard k_min {sums.k_min} is below policy.min_tail_guard "
                f"{self.config.policy.min_tail_guard}"
            )
        if self.silo_id in spec.participants:
            try:
                problems += self.gate.problems(sums.contribution_spec(sums.participants, sums.census), side)
            except FedltError as exc:
                problems.append(f"its sums are malformed: {exc}")
        return problems

    def _checked_state(self, stub, spec: round_pb2.RoundSpec, plan: RoundPlan) -> tuple | None:
        """(state, method) of the round, fetched and checked against the signed digest and schema; where
        this silo steps the model, kept for the server step."""
        self.activity = pb.SILO_ACTIVITY_FETCHING
        fetch_started = time.perf_counter()
        data = _fetch_state(stub, spec)
        if data is None:
            state_refused = RefusedRound(
                f"{spec.round_id}: the state streamed does not fit its signed size; not training",
                code=pb.REFUSAL_CODE_STATE,
            )
            self._refuse(stub, spec.round_id, state_refused)
            return None
        method = self._method_for(plan, spec.config_sha256)
        steps_model = self.sides[spec.privacy].steps_model
        try:
            if steps_model:
                secret = self.keys.secret(spec)
                state = opened_state(
                    data,
                    spec,
                    secret,
                    method,
                    older=self.keys.held(spec.privacy),
                    peers=self.sides[spec.privacy].peers,
                    min_counted=self.config.policy.min_survivors,
                )
            else:
                state = unpack_state(data, spec.round - 1)
        except FedltError as exc:
            problem = str(exc) or type(exc).__name__
        else:
            expected = expected_schema(plan, method, state, steps_model=steps_model)
            problem = _state_problem(method, state, spec, expected)
        if problem:
            refusal = RefusedRound(f"{spec.round_id}: {problem}; not training", code=pb.REFUSAL_CODE_STATE)
            self._refuse(stub, spec.round_id, refusal)
            return None
        log.debug(
            "round %d: state fetched and checked in %.3f s", spec.round, time.perf_counter() - fetch_started
        )
        if steps_model and self.silo_id in spec.participants:
            self._stepping = (spec.round_id, state, method)
        return state, method

    def _work(
        self,
        stub,
        spec: round_pb2.RoundSpec,
        plan: RoundPlan,
        trains: bool,
        state: GlobalState,
        method: Method,
    ) -> bytes | None:
        """Disclose if asked (the policy allowed it); train if a participant, and evaluate the starting state
        on the held-out slice where the plan asks."""
        if DISCLOSURE in spec.disclosures and self.silo_id in spec.disclosers:
            self._disclose(stub, spec, plan, method, state)
        if not trains:
            self.activity = pb.SILO_ACTIVITY_IDLE
            return None
        self.activity = pb.SILO_ACTIVITY_TRAINING
        started = time.perf_counter()
        private = self._privacy_for(plan, spec.config_sha256)
        schema = schema_from_pb(spec.schema)  # as `_checked_state` checked it
        try:
            contribution = round_contribution(
                schema,
                method,
                state,
                self.data,
                self.held_out,
                SiloContext(spec.round, self.silo_id, spec.seed, private),
            )
        except (BudgetExceeded, ContributionError) as exc:  # ContributionError: weights that train to inf
            self.activity = pb.SILO_ACTIVITY_IDLE
            self._refuse(stub, spec.round_id, _not_training(spec, exc))
            return None
        trained = time.perf_counter() - started
        self._announce_sigma(plan, spec.config_sha256)
        payload = np.ascontiguousarray(contribution.flat().numpy(), dtype="<f8").tobytes()
        atomic_write(self.state_dir / "pending.bin", lambda fh: fh.write(payload))
        atomic_write_text(self.state_dir / "pending.json", json.dumps(_pending_key(spec, state)))
        if evaluation_block.only_evaluates(schema):
            held_out = len(self.held_out) if self.held_out is not None else 0
            log.info("round %d: evaluated the last state on %d held-out samples", spec.round, held_out)
        else:
            log.info("round %d: trained on %d samples in %.2f s", spec.round, len(self.data), trained)
        return payload

    def _disclose(self, stub, spec: round_pb2.RoundSpec, plan: RoundPlan, method: Method, state) -> None:
        """MFSC: this silo's class means under the received model, random points for classes it lacks or holds
        too few samples of. One disclosure per round's state: a retried attempt sends the same bytes."""
        key = state.content_digest()  # one disclosure per state, whatever round the aggregator labels it
        values = self.ledger.disclosure(key)
        if values is None:
            minimum = max(plan.selection.min_samples, self.config.policy.disclosure_min_samples)
            stream = mask_stream(self._mask_secret(), key)
            means = class_mean_disclosure(
                method, state, self.data, plan.selection.mask, stream, min_samples=minimum
            )
            values = np.ascontiguousarray(means.numpy(), dtype="<f8").tobytes()
            self.ledger.record_disclosure(key, values)
        classes = method.model_spec.num_classes
        shape = [classes, len(values) // (8 * classes)]
        request = pb.DiscloseRequest(round_id=spec.round_id, name=DISCLOSURE, shape=shape, values=values)
        try:
            receipt = stub.Disclose(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as exc:  # the round goes on without it: picking falls back on older means
            reason = f"{exc.code().name}: {exc.details()}"
            log.warning("%s: the disclosure did not go through (%s)", spec.round_id, reason)
            return
        log.info(
            "round %d: disclosed masked class means (%s, mask %s) as policy.disclosures allows; sha256 %s",
            spec.round,
            DISCLOSURE,
            plan.selection.mask,
            receipt.sha256[:16],
        )

    def _mask_secret(self) -> bytes:
        """The key of this silo's MFSC masks: made once, kept in state_dir (owner-only), never sent."""
        path = self.state_dir / "mask.secret"
        if not path.exists():
            atomic_write(path, lambda fh: fh.write(secrets.token_bytes(32)))  # mkstemp: mode 0600
        return path.read_bytes()

    def _privacy_for(self, plan: RoundPlan, config_sha256: str) -> SiloPrivacy | None:
        """Under a plan with [dp]: this silo's DP for it, charged to the one ledger in its state folder; what
        it will do is logged once per plan, when first built (the administrator's only word that DP is on)."""
        if not plan.dp.enabled:
            return None
        if self._privacy is None or self._privacy[0] != config_sha256:
            method = self._method_for(plan, config_sha256)
            privacy = SiloPrivacy(plan.dp, method=method, ledger=self.privacy_ledger, run=config_sha256)
            self._privacy = (config_sha256, privacy)
            known = self._sgd_sigmas(config_sha256)  # trained under this plan before a restart
            sigma = known[0] if known else (plan.dp.noise_multiplier or None)
            log.info("plan %s…: %s", config_sha256[:16], _dp_summary(privacy, sigma))
        return self._privacy[1]

    def _sgd_sigmas(self, config_sha256: str) -> list[float]:
        """DP-SGD's σ at each training under this plan so far, as the ledger recorded it when admitted."""
        return [
            e["params"]["noise_multiplier"]
            for e in self.privacy_ledger.entries
            if e["mechanism"] == "dp-sgd" and e.get("run") == config_sha256
        ]

    def _announce_sigma(self, plan: RoundPlan, config_sha256: str) -> None:
        """After this plan's first DP-SGD training: the σ this silo chose for it (unknown until it knew its
        steps and sampling rate), once; later rounds and restarts find it in the ledger."""
        sigmas = self._sgd_sigmas(config_sha256) if plan.dp.enabled and not plan.dp.noise_multiplier else []
        if len(sigmas) == 1:
            log.info(
                "plan %s…: DP-SGD σ %.4g, the smallest that keeps the plan within ε %g",
                config_sha256[:16],
                sigmas[0],
                plan.dp.epsilon,
            )

    def _method_for(self, plan: RoundPlan, config_sha256: str) -> Method:
        """The same plan from round to round reuses one method (and its working model)."""
        if self._method is None or self._method[0] != config_sha256:
            self._method = (config_sha256, plan.build_method())
        return self._method[1]

    # --- what survives a restart ----------------------------------------------------------------

    def _pending(self, spec: round_pb2.RoundSpec, state: GlobalState) -> bytes | None:
        """The contribution this silo trained from this state (and for this schema) in an earlier attempt or
        before a restart: resent, not retrained, whatever the attempt, round label, plan text or seed, so a
        retry costs no privacy budget again and releases nothing new."""
        meta = self.state_dir / "pending.json"
        if meta.exists() and json.loads(meta.read_text()) == _pending_key(spec, state):
            log.info("%s: resending the contribution trained for round %d", spec.round_id, spec.round)
            return (self.state_dir / "pending.bin").read_bytes()
        return None

    def _clear_pending(self) -> None:
        for name in ("pending.json", "pending.bin"):
            (self.state_dir / name).unlink(missing_ok=True)

    def _progress(self) -> dict:
        path = self.state_dir / "progress.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_progress(self, **facts: object) -> None:
        atomic_write_text(self.state_dir / "progress.json", json.dumps({**self._progress(), **facts}))


def _layer_policy(name: str, config: SiloConfig) -> object:
    """The layer's reading of this silo's [policy] minimums (None for a layer that reads none)."""
    policy = record(name).policy
    return None if policy is None else policy(config.policy)


def _dp_summary(privacy: SiloPrivacy, sigma: float | None) -> str:
    """DP as this silo applies a plan: the plan's (ε, δ), DP-SGD's σ (None: chosen at the first training,
    from the steps and sampling rate it then knows), the statistics' noise and the budget left."""
    dp, ledger = privacy.settings, privacy.ledger
    sgd = "chosen at its first training" if sigma is None else f"{sigma:.4g}"
    return (
        f"differential privacy on: ε {dp.epsilon:g} at δ {dp.delta:g} for the plan; DP-SGD σ {sgd}, "
        f"clipping at {privacy.max_grad_norm:g}; statistics noise multiplier {privacy.statistics_noise:.4g}; "
        f"ε left in this silo's budget {ledger.remaining():.4g} of {ledger.budget.epsilon:g}"
    )


def _pending_key(spec: round_pb2.RoundSpec, state: GlobalState) -> dict[str, str]:
    """What a pending contribution was trained for: the state's content and the signed schema."""
    schema = hashlib.sha256(spec.schema.SerializeToString(deterministic=True)).hexdigest()
    return {"trained_from": state.content_digest(), "schema": schema}


def _round_id_of(signed: round_pb2.SignedRoundSpec) -> str:
    """The attempt a refused RoundSpec names, read whatever its signature: only to tell the aggregator which
    attempt is refused, which it takes for the attempt in flight alone. "" if it does not parse."""
    try:
        return round_pb2.RoundSpec.FromString(signed.spec).round_id
    except DecodeError:
        return ""


def _one_line(text: str) -> str:
    """`text` as the aggregator takes a refusal's: one printable line of at most TOLD_CHARS characters."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split()) or "refused"
    return line if len(line) <= TOLD_CHARS else line[: TOLD_CHARS - 1] + "…"


def _not_training(spec: round_pb2.RoundSpec, exc: BudgetExceeded | ContributionError) -> RefusedRound:
    """The refusal of a round whose training cannot be done: the budget's figures, or the values training
    gave, stay in the silo's log."""
    message = f"{spec.round_id}: not training: {exc}"
    if isinstance(exc, BudgetExceeded):
        return RefusedRound(message, code=pb.REFUSAL_CODE_BUDGET)
    return RefusedRound(
        message, code=pb.REFUSAL_CODE_OTHER, told="local training under this plan gave no finite update"
    )


def _state_problem(method: Method, state: GlobalState, spec: round_pb2.RoundSpec, expected: Schema) -> str:
    """Why the streamed state is not the round's ("" if it is): the signed digest, the signed schema (the
    one this silo `expected`), and a model the plan's network can hold."""
    if state.digest() != spec.state_digest:
        return "the state received does not match the signed digest"
    if expected != schema_from_pb(spec.schema):
        return "the signed schema differs from the method's own"
    unfit = _unfit_model(method, state)
    return f"the state's model {unfit}" if unfit else ""


def _unfit_model(method: Method, state: GlobalState) -> str:
    """Why the state's model is not one the plan's network can hold and train ("" if it is): its tensors'
    names, shapes and dtypes are the network's, and its floats finite. The digest and schema checks cannot
    tell: an aggregator signs the digest of whatever it sends, and a renamed tensor keeps the schema's size.
    """
    network = method.working_model().state_dict()
    model = state.model
    missing, unexpected = sorted(set(network) - set(model)), sorted(set(model) - set(network))
    if missing or unexpected:
        return f"lacks tensors {missing[:3]} and has others {unexpected[:3]}"
    for name, held in network.items():
        tensor = model[name]
        if tensor.shape != held.shape or tensor.dtype != held.dtype:
            wanted = f"{held.dtype} {tuple(held.shape)}"
            return f"holds {name!r} as {tensor.dtype} {tuple(tensor.shape)}, not {wanted}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"holds non-finite values in {name!r}"
    return ""


def _fetch_state(stub: consortium_pb2_grpc.ConsortiumServiceStub, spec: round_pb2.RoundSpec) -> bytes | None:
    """The streamed state, read only as far as the signed size: a longer or out-of-order stream is dropped."""
    data = bytearray()
    for part in stub.FetchState(pb.FetchStateRequest(round_id=spec.round_id), timeout=CALL_TIMEOUT):
        if part.offset != len(data) or len(data) + len(part.data) > spec.state_bytes:
            log.error("%s: the state streamed does not fit the signed size; not training", spec.round_id)
            return None
        data += part.data
    if len(data) != spec.state_bytes:
        log.error("%s: the state streamed is shorter than the signed size; not training", spec.round_id)
        return None
    return bytes(data)
