"""Assemble and run the aggregator: mutual-TLS gRPC server, round driver, store, evaluation, shutdown."""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import threading
from concurrent import futures
from pathlib import Path

import grpc
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aggregator.config import ConsortiumConfig
from aggregator.inbox import RoundInbox
from aggregator.key_service import KeyServiceRelay
from aggregator.rounds import RoundDriver
from aggregator.service import CertificateGate, ConsortiumServicer, Identity, OperatorServicer
from aggregator.status_page import (
    TOKEN_FILE,
    StatusPage,
    audit_tally,
    certificate_names,
    operator_tls,
    snapshot,
)
from aggregator.store import AuditKey, Store, StoreError
from fedlt.aggregation import make_layer, record
from fedlt.aggregation.halves import PartyKeys
from fedlt.atomic import atomic_write_text
from fedlt.config import as_table
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.dir_lock import AGGREGATOR_LOCK, DirectoryLock
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.keepalive import aggregator_options
from fedlt.listen import is_loopback, split_listen
from fedlt.recorder import RunRecorder
from fedlt.seeding import derive_seed
from fedlt.telemetry import TENSORBOARD, MlflowTarget, Telemetry, open_telemetry, tag_part
from fedlt.telemetry.prometheus import ConsortiumCollector, ConsortiumFacts, exposition
from fedlt.v1 import consortium_pb2, consortium_pb2_grpc, operator_pb2, operator_pb2_grpc
from privacy.peers import ConsortiumPeers
from privacy.pki.errors import PkiError
from privacy.pki.identity import (
    MemberTrust,
    RevocationList,
    check_issued_by,
    check_valid_now,
    load_certificate,
)
from privacy.pki.renewal import ExpiryWatch, Watched, aggregator_renewal, ca_watch, roster_watch
from privacy.pki.roster import RosterFile
from privacy.pki.signing import ROUNDSPEC_CONTEXT, load_private_key, sign

log = logging.getLogger("aggregator")

DATABASE = "consortium.sqlite"
LISTENING = "listening.json"
# Each connected silo holds one worker for its directive stream; the rest serve unary calls.
WORKERS = 128
AUDIT_CHAIN_INFO = b"fedlt/audit-chain/v1"
# How often certificates are looked at while serving; each warning is logged when it first comes up and when
# its text changes (the days left, daily).
WATCH_SECONDS = 600.0


def serve(config: ConsortiumConfig, *, stop: threading.Event | None = None, echo=print) -> int:
    stop = stop or threading.Event()
    tls = _read_tls(config)
    data_dir = config.path(config.server.data_dir)
    key = load_private_key(config.path(config.server.key))
    own = _check_own_certificate(config, tls, key)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = DirectoryLock.take(data_dir, name=AGGREGATOR_LOCK)  # one aggregator per data directory
    store = Store(data_dir / DATABASE, audit_key=derive_audit_key(key), retention=config.retention)
    method = config.plan.build_method()
    revocations = RevocationList.load(config.path(config.server.ca), config.path(config.server.crl))
    roster = RosterFile(config.path(config.server.roster), revocations=revocations)
    members = MemberTrust(tls["ca"], roster, revocations)
    watch = ExpiryWatch(
        lambda: [*own, *roster_watch(roster.current())],
        within_days=config.server.renew_within_days,
        problems=lambda: _roster_problems(roster, revocations),
        logger=log,
    )
    round_facts = _RoundFacts(store, dp=config.plan.dp.enabled)
    layer = make_layer(config.consortium.privacy, config.layer_settings())
    # the key service's relay, only where the layer asks for one (its record's `key_service`)
    relay = KeyServiceRelay.for_layer(record(config.consortium.privacy), config.layer_settings())
    rounds = RoundDriver(
        config=config,
        store=store,
        method=method,
        layer=layer,
        side=layer.aggregator_side(PartyKeys(peers=ConsortiumPeers(members), secret=relay)),
        sign=lambda blob: sign(key, blob, context=ROUNDSPEC_CONTEXT),
        recorder=_recorder(config, data_dir, store, facts=round_facts),
        echo=echo,
        roster=lambda: roster.current().silo_ids,
    )
    round_facts.rounds = rounds
    identity = Identity(revocations)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="grpc"),
        interceptors=[CertificateGate(identity)],
        options=aggregator_options(config.timeouts.keepalive),
    )
    servicer = ConsortiumServicer(
        rounds.inbox,
        store,
        identity,
        tls["certificate"],
        members=members,
        roster=roster,
        relay=relay,
        submit_seconds=config.timeouts.round,
    )
    consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server(servicer, server)
    operator_pb2_grpc.add_OperatorServiceServicer_to_server(
        OperatorServicer(rounds.inbox, identity, warnings=watch.warnings), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (
        consortium_pb2.DESCRIPTOR.services_by_name["ConsortiumService"].full_name,
        operator_pb2.DESCRIPTOR.services_by_name["OperatorService"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    credentials = grpc.ssl_server_credentials(
        [(tls["key"], tls["certificate"])], root_certificates=tls["ca"], require_client_auth=True
    )
    port = server.add_secure_port(config.server.listen, credentials)
    if port == 0:
        raise ConfigError("server.listen", [f"cannot listen on {config.server.listen}"])
    host = config.server.listen.rsplit(":", 1)[0]
    page = _status_page(config, rounds.inbox, store, revocations, watch)
    server.start()
    for name in services[:2]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    listening = {"address": f"{host}:{port}", "pid": os.getpid()}
    if page is not None:
        listening["status_page"] = page.url
        if page.token_file is not None:
            listening["status_page_token"] = str(page.token_file)
    atomic_write_text(data_dir / LISTENING, json.dumps(listening))
    echo(f"aggregator {config.consortium.id!r} listening on {host}:{port} (mutual TLS); data in {data_dir}")
    if page is not None:
        echo(f"status page (read-only): {page.url}")
        if page.token_file is not None:
            echo(f"  its access token is in {page.token_file}: open {page.url}?token=<that token> once")
    echo(f"privacy layer: {layer.describe()}")
    echo(_dp_line(config.plan.dp))
    _stop_on_signals(stop)
    watch.check()
    threading.Thread(target=watch.run, args=(stop, WATCH_SECONDS), name="certificates", daemon=True).start()
    driver = threading.Thread(target=rounds.run, args=(stop,), name="rounds", daemon=True)
    driver.start()
    try:
        while driver.is_alive():
            driver.join(0.5)
        if not stop.is_set() and not config.consortium.exit_when_done:
            stop.wait()
    finally:
        stop.set()
        health_servicer.enter_graceful_shutdown()
        if page is not None:
            page.stop()
        server.stop(grace=3).wait()
        store.close()
        lock.release()
    committed = rounds.table.held.round
    if rounds.recorder is not None and rounds.recorder.rounds:
        echo(f"\nfinal test accuracy after round {committed}:\n{rounds.recorder.finish()}")
    if rounds.recorder is not None:
        rounds.recorder.close()  # TensorBoard's files flushed, MLflow told what is left
    if rounds.failure is not None:
        echo(f"stopped after round {committed} on an internal error (see the log above)")
        return 1
    finished = committed >= config.consortium.rounds
    echo("all rounds committed" if finished else f"stopped after round {committed}")
    return 0


def _dp_line(dp: DPSettings) -> str:
    """The plan's [dp] as every silo applies it; each keeps its own ledger and chooses what it reports."""
    if not dp.enabled:
        return "differential privacy: off (the plan has no [dp]; an ε a silo reports is its lifetime budget)"
    sgd = f"{dp.noise_multiplier:g}" if dp.noise_multiplier else "chosen by each silo (the smallest within ε)"
    same = "the smallest within ε/2, the same at every silo"
    statistics = f"{dp.statistics_noise:g}" if dp.statistics_noise else same
    return (
        f"differential privacy: on, ε {dp.epsilon:g} at δ {dp.delta:g} per silo over the plan; DP-SGD σ "
        f"{sgd}, clipping at {dp.max_grad_norm:g}; statistics noise multiplier {statistics}; class counts "
        f"noised once, std {dp.count_noise:g}"
    )


def derive_audit_key(private_key: ec.EllipticCurvePrivateKey) -> AuditKey:
    """HKDF-SHA256 of the aggregator's private scalar: a copy of the database alone cannot forge the chain.

    Whoever holds the key file can sign RoundSpecs too, so the audit chain asks for nothing more secret than
    the aggregator already keeps; the info string separates this use from every other use of the key.
    """
    size = (private_key.curve.key_size + 7) // 8
    scalar = private_key.private_numbers().private_value.to_bytes(size, "big")
    return AuditKey(HKDF(hashes.SHA256(), length=32, salt=None, info=AUDIT_CHAIN_INFO).derive(scalar))


def _read_tls(config: ConsortiumConfig) -> dict[str, bytes]:
    files = {"certificate": config.server.certificate, "key": config.server.key, "ca": config.server.ca}
    missing = [
        f"server.{name}: no such file {config.path(p)}"
        for name, p in files.items()
        if not config.path(p).is_file()
    ]
    if missing:
        raise ConfigError(config.base_dir / "consortium.toml", missing)
    return {name: config.path(p).read_bytes() for name, p in files.items()}


def _check_own_certificate(
    config: ConsortiumConfig, tls: dict[str, bytes], key: ec.EllipticCurvePrivateKey
) -> list[Watched]:
    """Refuse to start on a certificate silos would refuse (expired, not yet valid, another CA's, not the
    key's), saying which and what renews it; else the aggregator's certificate and the CA, to watch."""
    server = config.server
    ca = load_certificate(tls["ca"], source=f"server.ca {config.path(server.ca)}")
    cert = load_certificate(
        tls["certificate"], source=f"server.certificate {config.path(server.certificate)}"
    )
    try:
        check_valid_now(ca)
    except PkiError as exc:
        raise PkiError(f"the consortium CA certificate {config.path(server.ca)}: {exc}") from None
    check_issued_by(cert, ca)
    try:
        check_valid_now(cert)
    except PkiError as exc:
        raise PkiError(
            f"the aggregator's certificate {config.path(server.certificate)}: {exc}; renew it with "
            f"{aggregator_renewal()}"
        ) from None
    if key.public_key() != cert.public_key():
        raise PkiError(f"{config.path(server.key)} is not the key of {config.path(server.certificate)}")
    where = config.path(server.certificate)
    return [
        Watched(f"the aggregator's certificate {where}", cert, aggregator_renewal()),
        ca_watch(ca, str(config.path(server.ca))),
    ]


def _roster_problems(roster: RosterFile, revocations: RevocationList) -> list[str]:
    """What stops a member the roster names: a roster silos will not adopt, a certificate the CA revoked."""
    problems = [roster.problem] if roster.problem else []
    current = roster.current()
    for m in current.members:
        cert = m.cert
        if revocations.is_revoked(cert):
            problems.append(
                f"roster v{current.version} names {m.id}'s certificate (serial {cert.serial_number:x}), "
                f"which the CA has revoked: {m.id} cannot take part until a roster naming a valid "
                "certificate of it is in force"
            )
    return problems


class _RoundFacts:
    """Each recorded round's facts besides its accuracy, for TensorBoard and MLflow: from the audit log, the
    silos the round invited, those its sum counted and the difference; from the round table, each silo's ε
    left as it reported it (under [dp]) and the bytes of the state silos download. The table is known once
    the round driver is made (`rounds`); a round recorded before (a restart's catch-up) goes without them."""

    def __init__(self, store: Store, *, dp: bool) -> None:
        self.store, self.dp = store, dp
        self.rounds: RoundDriver | None = None

    def __call__(self, round_number: int) -> dict[str, float]:
        found: dict[str, float] = {}
        silos = audit_tally(self.store.audit_log()).rounds.get(round_number)
        if silos is not None:
            invited, counted = silos
            found["silos/invited"], found["silos/counted"] = len(invited), len(counted)
            found["silos/dropouts"] = len(set(invited) - set(counted))
        if self.rounds is None:
            return found
        found["bytes/state"] = len(self.rounds.table.held.blob)
        for silo in self.rounds.inbox.status()["silos"] if self.dp else []:
            if silo.get("privacy_remaining") is not None:
                found[f"privacy/epsilon_remaining/{tag_part(silo['silo_id'])}"] = silo["privacy_remaining"]
        return found


def _telemetry(
    config: ConsortiumConfig,
    data_dir: Path,
    history: list[dict],
    classes: tuple[str, ...],
    facts: _RoundFacts | None,
) -> Telemetry:
    """TensorBoard's event files in data_dir/tensorboard and the MLflow run, as [monitoring] says; the MLflow
    run is this data directory's (a new data directory, a new run)."""
    monitoring = config.monitoring
    mlflow = None
    if monitoring.mlflow_uri:
        mlflow = MlflowTarget(
            monitoring.mlflow_uri,
            monitoring.mlflow_experiment,
            monitoring.mlflow_run or config.consortium.id,
            key=f"{data_dir.resolve()}|{config.consortium.id}",
        )
    folder = data_dir / TENSORBOARD if monitoring.tensorboard else None
    return open_telemetry(folder, history=history, classes=classes, mlflow=mlflow, extra=facts)


def _recorder(
    config: ConsortiumConfig, data_dir: Path, store: Store, *, facts: _RoundFacts | None = None
) -> RunRecorder | None:
    """Where rounds are evaluated: the silos' summed held-out counts, or the operator's own evaluation set;
    the history is restored from the store. `facts`: each round's facts besides its accuracy, for its
    telemetry."""
    evaluation, method = config.evaluation, config.plan.method.name
    header = {"consortium": as_table(config.consortium), "plan": as_table(config.plan)}
    history = store.metrics_history()
    if config.silos_evaluate and not evaluation.dataset:
        # with held-out evaluation the shot groups' counts are summed in round 1, kept with round 0's metrics
        kept = next((entry["train_counts"] for entry in history if "train_counts" in entry), None)
        counts = evaluation.class_counts or kept
        classes = tuple(config.plan.model.classes)
        return RunRecorder(
            data_dir / "run",
            title=f"{method} consortium {config.consortium.id!r}, evaluated on the silos' held-out data",
            test=None,
            classes=classes,
            train_counts=counts,
            thresholds=config.metrics,
            header=header,
            rounds=history,
            telemetry=_telemetry(config, data_dir, history, classes, facts),
        )
    if not evaluation.dataset:
        return None
    seed = derive_seed(config.consortium.seed, "test-split")
    _, test = split_balanced_test(
        load_embedded(evaluation.dataset), per_class=evaluation.test_per_class, seed=seed
    )
    return RunRecorder(
        data_dir / "run",
        title=f"{method} consortium {config.consortium.id!r}, evaluated on {evaluation.dataset}",
        test=test,
        train_counts=evaluation.class_counts or None,
        thresholds=config.metrics,
        header=header,
        rounds=history,
        telemetry=_telemetry(config, data_dir, history, tuple(test.classes), facts),
    )


def _status_page(
    config: ConsortiumConfig,
    inbox: RoundInbox,
    store: Store,
    revocations: RevocationList,
    watch: ExpiryWatch,
) -> StatusPage | None:
    if not config.server.status_page:
        return None
    about = {
        "consortium_id": config.consortium.id,
        "method": config.plan.method.name,
        "privacy": config.consortium.privacy,
        "total_rounds": inbox.total_rounds,
        "dp_enabled": config.plan.dp.enabled,
    }
    server = config.server
    try:
        host, _ = split_listen(server.status_page)
        tls, names, token_file = None, [], None
        if is_loopback(host):
            token_file = config.path(server.status_page_token or f"{server.data_dir}/{TOKEN_FILE}")
        else:
            certificate = config.path(server.certificate)
            tls = operator_tls(certificate, config.path(server.key), config.path(server.ca))
            names = certificate_names(certificate)
        page = StatusPage(
            server.status_page,
            lambda: snapshot({**inbox.status(), "certificate_warnings": watch.warnings()}, about, store),
            revocations,
            tls,
            token_file=token_file,
            names=names,
            connections=server.status_page_connections,
            metrics=lambda: exposition(ConsortiumCollector(consortium_facts(config, inbox, store, watch))),
        )
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise ConfigError("server.status_page", [f"cannot serve the status page: {exc}"]) from None
    return page.start()


def consortium_facts(
    config: ConsortiumConfig, inbox: RoundInbox, store: Store, watch: ExpiryWatch
) -> ConsortiumFacts:
    """What `/metrics` shows, gathered at each scrape: the round table's view, the recorded metrics, and
    what the audit log says (its chain verified over every record, as the status page does)."""
    status, records = inbox.status(), store.audit_log()
    tally = audit_tally(records)
    try:
        store.verify_audit()
        verified = True
    except StoreError:
        verified = False
    return ConsortiumFacts(
        consortium=config.consortium.id,
        method=config.plan.method.name,
        privacy=config.consortium.privacy,
        planned_rounds=inbox.total_rounds,
        committed_rounds=status["committed_rounds"],
        dp_enabled=config.plan.dp.enabled,
        classes=config.plan.model.classes,
        silos=status["silos"],
        history=store.metrics_history(),
        attempts=tally.attempts,
        refusals=tally.refusals,
        dropouts=tally.dropouts,
        contributions=tally.contributions,
        state_bytes=len(inbox.table.held.blob),
        audit_verified=verified,
        audit_records=len(records),
        certificate_warnings=len(watch.warnings()),
    )


def _stop_on_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
