"""The silo agent: connect, check every claim the aggregator makes, train, upload; survive restarts.

`SiloAgent` wires the parts, each in its own module, and dispatches the aggregator's directives to them:
- `silo.connection`: this silo's certificate and its renewal, the session kept up with backoff, registration
  and heartbeats, against the pinned roster (`silo.trust`);
- `silo.admission`: each signed RoundSpec checked against the roster and the policy and read once, with the
  release gate; then its starting state, fetched and checked;
- `silo.work`: disclosure and training, the contribution kept on disk until its upload is taken;
- `silo.finish`: this silo's part in the round's sums, the model stepped where only silos read the sum, the
  evaluation sum, and the progress kept;
- `silo.transport`: every call to the aggregator, handed to each part by the session;
- `fedlt.telemetry.prometheus.SiloMetrics`: this silo's own counts, served to its Prometheus where
  `[monitoring] prometheus` asks.

An agent takes part in one study: the aggregator's default one (silo.toml without `[study.*]` tables: every
file in `state_dir`, as before studies existed), or the one its config is for (`SiloConfig.for_study`: its own
files in `studies/<id>/`, the silo's ledgers, roster and mask secret shared with its other studies' agents at
the top of `state_dir`; `silo.studies`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import replace

import torch

from fedlt.aggregation import make_layer, record
from fedlt.aggregation.halves import PartyKeys, Signer, SiloSide
from fedlt.device import resolve_device
from fedlt.dir_lock import DirectoryLock
from fedlt.errors import ConfigError
from fedlt.studies import DEFAULT_STUDY
from fedlt.telemetry.prometheus import MetricsServer, SiloMetrics
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.peers import ConsortiumPeers
from silo.admission import Admission, PlanCache, RefusedRound
from silo.budget import ledger_path, open_ledger
from silo.config import SiloConfig
from silo.connection import Connection, Progress, RunningCertificate, Standing
from silo.finish import Finish
from silo.key_service import KeyService
from silo.releases import ReleaseLedger, check_ledgers
from silo.studies import RootHold, adopt_single_run
from silo.transport import SiloTransport
from silo.trust import SiloTrust
from silo.work import PendingContribution, Work

log = logging.getLogger("silo")


class SiloAgent:
    """One silo's agent for one state directory: its parts made and wired, the directives handed to them."""

    def __init__(self, config: SiloConfig, *, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        # this silo's own device, whatever a plan says; a GPU that is not there stops the agent here, saying
        # so, before anything is written
        self.device = resolve_device(config.compute.device, setting="compute.device")
        self.state_dir = config.path(config.state_dir)  # this study's own (the silo's, without studies)
        shared = config.shared_dir()  # what the silo keeps across its studies
        # a study's agent shares the silo's directory with its other studies' agents, never with an agent
        # without studies (which takes it whole)
        self.shared_hold = RootHold(shared) if config.study else None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # one agent per state directory, for this process's life: a second would lose the first's records
        self.state_lock = DirectoryLock.take(self.state_dir)
        if config.study == DEFAULT_STUDY:
            adopt_single_run(shared, self.state_dir)
        check_ledgers(shared, ledger_path(config))  # before anything here is written
        if config.compute.threads:
            torch.set_num_threads(config.compute.threads)
        local = config.load_data()  # this silo's data as its files label it
        # this silo's certificate and key: checked now (an expired one stops the agent, saying so), and
        # watched for a renewed pair installed over them
        self.certificate = RunningCertificate(config)
        log.info("computing on %s (compute.device = %r)", self.device, config.compute.device)
        conn = config.connection
        self.trust = SiloTrust(
            shared,
            ca_pem=self.certificate.ca_pem,
            kit_roster=config.path(conn.roster),
            crl=config.path(conn.crl) if conn.crl else None,
            quorum_above=config.policy.roster_quorum_above,
        )
        self.ledger = ReleaseLedger(shared)
        self.privacy_ledger = open_ledger(config)  # one per silo, across plans; read once, then kept in step
        self.privacy_ledger.keep()
        self.ledger.note_privacy_ledger()
        self.metrics = SiloMetrics(
            refusal_codes=[_code_name(code) for code in pb.RefusalCode.values() if code],
            epsilon_spent=self.privacy_ledger.spent,
            epsilon_budget=config.dp.epsilon,
        )
        self.certificate.expiry_warnings()
        # the key service, for each layer the policy lists that asks for one
        self.keys = KeyService(
            self.state_dir, config.policy.privacy, trust=self.trust, sign=self.certificate.sign
        )
        # held-out data, evaluated inside a sum under whichever layer
        local_held_out = config.load_evaluation()
        self.standing, self.progress = Standing(), Progress(self.state_dir)
        self.plans = PlanCache(self.privacy_ledger, device=str(self.device))
        self.pending = PendingContribution(self.state_dir)
        self.admission = Admission(
            config,
            trust=self.trust,
            ledger=self.ledger,
            keys=self.keys,
            sides=_sides(config, self.keys, self.trust, self.certificate.sign),
            plans=self.plans,
            standing=self.standing,
            local=local,
            local_held_out=local_held_out,
        )
        # the admission refuses through its `refuse`, and hands it to the work: every refusal passes here
        self._refuse, self.admission.refuse = self.admission.refuse, self._refused
        self.work = Work(
            shared,
            config.policy,
            ledger=self.ledger,
            plans=self.plans,
            pending=self.pending,
            standing=self.standing,
            refuse=self.admission.refuse,
        )
        self.finish = Finish(
            self.state_dir,
            gate=self.admission.gate,
            ledger=self.ledger,
            keys=self.keys,
            plans=self.plans,
            pending=self.pending,
            standing=self.standing,
            progress=self.progress,
            sign=self.certificate.sign,
        )
        self.connection = Connection(
            config,
            stop=self.stop,
            certificate=self.certificate,
            trust=self.trust,
            keys=self.keys,
            standing=self.standing,
            progress=self.progress,
            privacy_ledger=self.privacy_ledger,
            follow=self.follow,
            on_switch=self.finish.drop,
        )
        # bound now, so that a port in use stops the agent at its start, saying so; served by `run`
        self.metrics_endpoint = _metrics_endpoint(config, self.metrics)

    def run(self) -> int:
        """Keep a session up until the consortium is finished (`silo.connection.Connection.run`), serving
        this silo's metrics meanwhile where it is asked to."""
        endpoint = self.metrics_endpoint
        if endpoint is None:
            return self.connection.run()
        endpoint.start()
        log.info("metrics for Prometheus at %s", endpoint.url)
        try:
            return self.connection.run()
        finally:
            endpoint.stop()

    def follow(self, transport: SiloTransport, stream: Iterator[pb.JoinResponse]) -> bool:
        """Act on directives until the stream ends; True when the consortium is finished."""
        self.metrics.contact()
        self.metrics.connected.set(1)
        try:
            return self._follow(transport, stream)
        finally:
            self.metrics.connected.set(0)

    def _follow(self, transport: SiloTransport, stream: Iterator[pb.JoinResponse]) -> bool:
        for directive in stream:
            self.metrics.contact()
            if (
                directive.roster
                and self.trust.offer_roster(directive.roster)
                and self.certificate.renewal_due(self.trust)
            ):
                return False  # the next session presents the renewed certificate the roster now names
            kind = directive.WhichOneof("directive")
            if kind == "round_spec":
                self.take_round(transport, directive.round_spec)
            elif kind == "sum_step":
                self.finish.sum_step(transport, directive.sum_step)
            elif kind == "abort":
                log.warning("aggregator aborted %s: %s", directive.abort.round_id, directive.abort.reason)
                self.finish.aborted(directive.abort.round_id)
            elif kind == "finished":
                done = directive.finished
                rounds = f"{done.rounds} round{'' if done.rounds == 1 else 's'}"
                if self.config.study:  # done, or cancelled by its operator: the aggregator says only that
                    log.info(
                        "study %r ended after %s (state %s)",
                        self.config.study,
                        rounds,
                        done.state_digest[:16],
                    )
                else:
                    log.info("consortium finished after %s (state %s)", rounds, done.state_digest[:16])
                self.progress.save(committed=done.rounds)
                return True
        return False

    def take_round(self, transport: SiloTransport, signed: round_pb2.SignedRoundSpec) -> None:
        """One RoundSpec: admitted (or refused), its state checked, the work done and the sums joined; or, for
        the round whose sums this silo is still in, those sums resumed after a reconnect."""
        admitted = self.admission.admit(transport, signed)
        if admitted is None or self.finish.resumed(transport, admitted.spec.round_id):
            return
        self.standing.round_id = admitted.spec.round_id
        self.finish.drop()
        started = self.admission.starting_state(transport, admitted)
        if started is None:
            return
        payload = self.pending.resent(started) if started.trains else None
        payload = payload or self.work.train(transport, started)
        if payload is not None:
            self.metrics.rounds.inc()
            self.finish.take_part(transport, started, payload)

    def _refused(self, transport: SiloTransport, round_id: str, refusal: RefusedRound) -> None:
        self.metrics.refusals.labels(_code_name(refusal.code)).inc()
        self._refuse(transport, round_id, refusal)


def _code_name(code: int) -> str:
    """A RefusalCode as operators read it: `REFUSAL_CODE_POLICY` is "policy"."""
    return pb.RefusalCode.Name(code).removeprefix("REFUSAL_CODE_").lower()


def _metrics_endpoint(config: SiloConfig, metrics: SiloMetrics) -> MetricsServer | None:
    """The endpoint `[monitoring] prometheus` names, bound; None where it names none."""
    listen = config.monitoring.prometheus
    if not listen:
        return None
    try:
        return MetricsServer(listen, metrics.exposition)
    except OSError as exc:
        raise ConfigError("monitoring.prometheus", [f"cannot serve metrics on {listen}: {exc}"]) from None


def _sides(config: SiloConfig, keys: KeyService, trust: SiloTrust, sign: Signer) -> dict[str, SiloSide]:
    """Each layer the policy accepts, as this silo uses it, with its reading of the policy's minimums; a
    RoundSpec naming another is refused."""
    party = PartyKeys(sign=sign, peers=ConsortiumPeers(trust.members))
    return {
        name: make_layer(name).silo_side(
            replace(party, policy=_layer_policy(name, config), secret=keys.secret_for(name))
        )
        for name in config.policy.privacy
    }


def _layer_policy(name: str, config: SiloConfig) -> object:
    """The layer's reading of this silo's [policy] minimums (None for a layer that reads none)."""
    policy = record(name).policy
    return None if policy is None else policy(config.policy)
