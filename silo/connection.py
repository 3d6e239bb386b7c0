"""The silo's connection to the aggregator: its certificate, the session kept up, registration, heartbeats.

Trust comes from the silo's pinned roster (`silo.trust`), not from the aggregator: the aggregator's TLS
endpoint and RoundSpec signer must be the roster's aggregator, and every peer the roster's silo of that id.
A newer roster the aggregator offers (at registration, in heartbeat replies, with a RoundSpec) is adopted only
if a quorum signed it; the silo's own certificate, re-read when replaced on disk, is switched to a renewed
one once the roster names it (`silo.trust.OwnCertificate`). A session is one channel, its transport
(`silo.transport`) and the directive stream; when it fails the agent reconnects with jittered exponential
backoff, and what no retry can mend stops the agent (`Fatal`). A study's agent names its study on every
call of the channel (`silo.transport.study_channel`); while the aggregator does not take the study (queued,
paused: UNAVAILABLE; not created yet: NOT_FOUND) it says so once per change and waits with the same backoff.

`Standing` is where this silo stands with the aggregator, shared by the agent's parts: who it is to the
aggregator and what it is doing (what heartbeats report); `Progress`, what a restarted agent joins from.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedlt.atomic import atomic_write_text
from fedlt.errors import FedltError
from fedlt.keepalive import silo_options
from fedlt.listen import split_listen
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.dp import PrivacyLedger
from privacy.pki.errors import PkiError
from privacy.pki.renewal import ExpiryWatch
from privacy.pki.signing import sign
from silo.config import SiloConfig
from silo.key_service import KeyService
from silo.tls_probe import UNTRUSTED, ConnectionProblem, UntrustedAggregator, server_certificate
from silo.transport import CALL_TIMEOUT, SiloTransport, study_channel
from silo.trust import Credentials, OwnCertificate, SiloTrust, expiry_watch, switch_due

log = logging.getLogger("silo")

VERSION = "fedlt-silo/0.1"


class Fatal(FedltError):
    """A condition retrying cannot fix: refused certificate, wrong consortium, an aggregator this silo's kit
    does not trust; `python -m silo run` exits 2 with its message."""


class RunningCertificate:
    """This silo's certificate and key as its sessions present them and its signatures use them: checked at
    start (an expired one stops the agent, saying so), and watched for a renewed pair installed over them,
    which the next session presents once the pinned roster names it."""

    def __init__(self, config: SiloConfig) -> None:
        conn = config.connection
        try:
            self.ca_pem = config.path(conn.ca).read_bytes()
        except OSError as exc:
            raise PkiError(
                f"cannot read the consortium CA certificate {config.path(conn.ca)}: {exc.strerror}"
            ) from None
        self.own = OwnCertificate(
            config.path(conn.certificate), config.path(conn.key), self.ca_pem, ca_path=config.path(conn.ca)
        )
        self._use(self.own.read())
        self._switch_to: Credentials | None = None
        self._expiry = ExpiryWatch(
            lambda: expiry_watch(self.running, self.own), within_days=conn.renew_within_days, logger=log
        )

    def _use(self, credentials: Credentials) -> None:
        self.running = credentials
        self.channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=credentials.key_pem,
            certificate_chain=credentials.cert_pem,
        )
        self.me = credentials.silo_id

    def sign(self, data: bytes, *, context: str) -> bytes:
        return sign(self.running.key, data, context=context)

    @property
    def switch_pending(self) -> bool:
        return self._switch_to is not None

    def expiry_warnings(self) -> None:
        """At start and at each registration: each warning once a day (its days left change daily)."""
        self._expiry.check()

    def renewal_due(self, trust: SiloTrust) -> bool:
        """Whether the certificate files hold a renewed pair the pinned roster names (checked after each
        heartbeat and roster offered): then this session ends (its stream is cancelled) and the next one
        presents it. Switching only once the roster names it keeps peers holding the roster accepting it."""
        if self._switch_to is None:
            renewed = self.own.renewed(self.running)
            if switch_due(trust, self.running, renewed):
                self._switch_to = renewed
        return self._switch_to is not None

    def switch(self, *, refused: bool) -> bool:
        """Take the renewed certificate for the next session: one found due, or, after the aggregator refused
        the running one, any valid renewed pair on disk (the aggregator's roster may name it already; this
        silo adopts that roster once registered). False if there is none."""
        renewed = self._switch_to or (self.own.renewed(self.running) if refused else None)
        self._switch_to = None
        if renewed is None:
            return False
        log.warning("switching to the renewed certificate (%s); reconnecting", renewed.describe())
        self._use(renewed)
        return True


class Connection:
    """Keeps a session up until the consortium is finished. `follow` acts on a session's directive stream
    (True once the consortium is finished); `on_switch` is told when the next session presents another
    certificate."""

    def __init__(
        self,
        config: SiloConfig,
        *,
        stop: threading.Event,
        certificate: RunningCertificate,
        trust: SiloTrust,
        keys: KeyService,
        standing: Standing,
        progress: Progress,
        privacy_ledger: PrivacyLedger,
        follow: Callable[[SiloTransport, Iterator[pb.JoinResponse]], bool],
        on_switch: Callable[[], None],
    ) -> None:
        self.config, self.stop, self.certificate, self.trust, self.keys = (
            config,
            stop,
            certificate,
            trust,
            keys,
        )
        self.standing, self.progress, self.privacy_ledger = standing, progress, privacy_ledger
        self._follow, self._on_switch = follow, on_switch
        self._waiting = StudyWait(config.study, config.connection.aggregator)

    def run(self) -> int:
        """Keep a session up until the consortium is finished, with jittered exponential backoff; what no
        retry can mend (this silo refused, an aggregator its kit does not trust) raises Fatal."""
        backoff = 1.0
        address = self.config.connection.aggregator
        try:
            split_listen(address)
        except ValueError:  # no retry mends it; said before any dial, not as a traceback from the probe
            raise Fatal(
                f"connection.aggregator in silo.toml: expected host:port, such as "
                f"'aggregator.example.org:50051'; got {address!r}"
            ) from None
        while not self.stop.is_set():
            try:
                if self._session():
                    return 0
                backoff = 1.0
                if self.certificate.switch_pending:
                    continue  # the session ended to present the renewed certificate: at once
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break
                code = exc.code()
                refused = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                if self.certificate.switch_pending or (refused and self._switch(refused=True)):
                    continue
                if refused:
                    raise Fatal(f"the aggregator at {address} refuses this silo: {exc.details()}") from None
                if not self._waiting.said(code, exc.details()):
                    problem = f"a call to the aggregator at {address} failed ({code.name}: {exc.details()})"
                    log.warning("connection problem: %s; retrying in %.0f s", problem, backoff)
            except OSError as exc:  # the probe's ConnectionProblem says where and what it likely means
                if self.stop.is_set():
                    break
                problem = exc if isinstance(exc, ConnectionProblem) else f"cannot reach {address}: {exc}"
                log.warning("connection problem: %s; retrying in %.0f s", problem, backoff)
            self.stop.wait(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.config.connection.max_backoff_seconds)
        log.info("stopped on request; progress is kept in %s", self.config.path(self.config.state_dir))
        return 0

    def _switch(self, *, refused: bool) -> bool:
        if not self.certificate.switch(refused=refused):
            return False
        self._on_switch()
        return True

    def _session(self) -> bool:
        if self.certificate.switch_pending:
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
                ca_pem=self.certificate.ca_pem,
                certificate=self.config.path(conn.certificate),
                key=self.config.path(conn.key),
            )
        except UntrustedAggregator as exc:  # this silo's kit or address is wrong: a retry sees the same
            raise Fatal(str(exc)) from None
        credentials = self.certificate.channel_credentials
        try:
            with grpc.secure_channel(conn.aggregator, credentials, options=options) as channel:
                named = study_channel(channel, self.config.study)
                transport = SiloTransport(consortium_pb2_grpc.ConsortiumServiceStub(named))
                self.register(transport, tls_pem)
                self._waiting.taken()
                stream = transport.join(self.progress.read().get("committed", 0))
                helpers = [
                    threading.Thread(target=self._heartbeats, args=(transport, session_over), daemon=True),
                    threading.Thread(target=self._cancel_on_stop, args=(stream, session_over), daemon=True),
                ]
                for helper in helpers:
                    helper.start()
                try:
                    return self._follow(transport, stream)
                finally:
                    session_over.set()
                    stream.cancel()
        finally:
            # gRPC's C core can abort the process ("terminate called without an active exception") when
            # the interpreter exits with a call still in flight on a daemon thread: end the helpers first.
            for helper in helpers:
                helper.join(timeout=CALL_TIMEOUT)

    def _cancel_on_stop(self, stream: grpc.Future, session_over: threading.Event) -> None:
        while not session_over.wait(0.2):
            if self.stop.is_set() or self.certificate.switch_pending:
                stream.cancel()
                return

    def register(self, transport: SiloTransport, tls_pem: bytes) -> None:
        """Register, take any newer roster or CRL offered, then check the aggregator against the roster."""
        policy = self.config.policy
        request = pb.RegisterRequest(
            agent_version=VERSION,
            accepted_methods=policy.methods,
            accepted_privacy=policy.privacy,
            accepted_disclosures=policy.disclosures,
            key_enrollment=self.keys.enrollment(self.certificate.me),
        )
        try:
            reply = transport.register(request)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a retry would send the same again
                raise Fatal(f"the aggregator refuses this silo's registration: {exc.details()}") from None
            raise
        self.trust.offer_crl(reply.crl)  # first: a revocation it carries counts against the roster's signers
        self.trust.offer_roster(reply.roster)
        self.certificate.renewal_due(self.trust)  # says once if the roster names another certificate
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
        self.standing.aggregator_pem, self.standing.silo_id = reply.aggregator_certificate, reply.silo_id
        log.info("registered as %s with consortium %r", reply.silo_id, reply.consortium_id)
        self.certificate.expiry_warnings()
        self.keys.registered(transport, reply)

    def _heartbeat(self) -> pb.HeartbeatRequest:
        """Activity, and the ε left in this silo's budget if (and only if) its dp.report says to tell."""
        request = pb.HeartbeatRequest(
            round_id=self.standing.round_id,
            activity=self.standing.activity,
            roster_sha256=self.trust.roster.digest(),
            crl_sha256=self.trust.crl_sha256,
        )
        if self.config.dp.report:
            request.privacy_remaining = self.privacy_ledger.remaining()
        return request

    def _heartbeats(self, transport: SiloTransport, session_over: threading.Event) -> None:
        while not session_over.wait(self.config.connection.heartbeat_seconds) and not self.stop.is_set():
            try:
                reply = transport.heartbeat(self._heartbeat())
                if reply.crl:  # first: a revocation it carries counts against the roster's signers
                    self.trust.offer_crl(reply.crl)
                self.trust.offer_roster(reply.roster)  # a running silo adopts a newer roster here
                if self.certificate.renewal_due(self.trust):
                    return  # the stream is cancelled; the next session presents the renewed certificate
                if self.keys.keyrings:  # a layer with the key service: as its key holder, seal to newcomers
                    self.keys.heartbeat(transport)
            except grpc.RpcError:
                return


class StudyWait:
    """What a study's agent says while the aggregator does not take its study: once per change of the
    aggregator's answer, in plain words (the retries in between are logged at debug level only)."""

    def __init__(self, study: str, address: str) -> None:
        self.study, self.address = study, address
        self._last: tuple[grpc.StatusCode, str] | None = None

    def said(self, code: grpc.StatusCode, details: str) -> bool:
        """Whether `code` is the aggregator's word on this study, which is then said (once) or repeated
        quietly; False for any other code, and for an answer to the default study's agent (which names no
        study) that names none either: a connection problem, said as before studies."""
        # the default study's agent names no study; the aggregator's words on the study name it
        named = _NAMED.match(details)
        about = self.study or (named.group(1) if named else "")
        wording = _WAITING.get(code) if about else None
        if wording is None:
            return False
        if self._last == (code, details):
            log.debug("study %r: still waiting (%s: %s)", about, code.name, details)
            return True
        self._last = (code, details)
        log.warning(wording.format(study=about, address=self.address, details=details or code.name))
        return True

    def taken(self) -> None:
        """Registered: the aggregator takes the study (a later wait is a change, and said again)."""
        if self._last is not None:
            log.info("the aggregator takes the study now")
        self._last = None


_NAMED = re.compile(r"study '([a-z0-9-]+)' ")  # how the aggregator's answers on a study begin
_WAITING = {
    grpc.StatusCode.UNAVAILABLE: "study {study!r} is not open on the aggregator at {address} now "
    "({details}); waiting",
    grpc.StatusCode.NOT_FOUND: "study {study!r} is not on the aggregator at {address} ({details}); waiting "
    "for its operator to create it (python -m aggregator study create), or check the id of [study.{study}] "
    "in silo.toml",
}


@dataclass
class Standing:
    """The id the aggregator registered this silo under and the aggregator's certificate (both from the last
    registration), and what the heartbeats report: the attempt this silo works on, and at what."""

    silo_id: str = ""
    aggregator_pem: bytes = b""
    round_id: str = ""
    activity: int = pb.SILO_ACTIVITY_IDLE


class Progress:
    """progress.json in the state directory: the last round the consortium committed and the attempt this
    silo last submitted to, kept across restarts (the directive stream is joined from `committed`)."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / "progress.json"

    def read(self) -> dict:
        return json.loads(self._path.read_text()) if self._path.exists() else {}

    def save(self, **facts: object) -> None:
        atomic_write_text(self._path, json.dumps({**self.read(), **facts}))
