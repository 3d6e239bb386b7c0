"""Assemble and run the aggregator: mutual-TLS gRPC server, round driver, store, evaluation, shutdown."""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import threading
from concurrent import futures

import grpc
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aggregator.config import ConsortiumConfig
from aggregator.service import CertificateGate, Identity, OperatorServicer
from aggregator.status_page import (
    TOKEN_FILE,
    StatusPage,
    certificate_names,
    operator_tls,
    study_states,
)
from aggregator.store import AuditKey
from aggregator.studies import Studies, StudyRouter
from aggregator.study_run import Shared
from fedlt.atomic import atomic_write_text
from fedlt.dir_lock import AGGREGATOR_LOCK, DirectoryLock
from fedlt.errors import ConfigError
from fedlt.keepalive import aggregator_options
from fedlt.listen import is_loopback, split_listen
from fedlt.telemetry.prometheus import ConsortiumCollector, exposition
from fedlt.v1 import consortium_pb2, consortium_pb2_grpc, operator_pb2, operator_pb2_grpc
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
    """Serve every study of the data directory (`aggregator.studies`) until none runs or waits, where
    `[consortium] exit_when_done`, else until stopped; 1 if a study stopped on an error meanwhile."""
    stop = stop or threading.Event()
    tls = _read_tls(config)
    data_dir = config.path(config.server.data_dir)
    key = load_private_key(config.path(config.server.key))
    own = _check_own_certificate(config, tls, key)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = DirectoryLock.take(data_dir, name=AGGREGATOR_LOCK)  # one aggregator per data directory
    revocations = RevocationList.load(config.path(config.server.ca), config.path(config.server.crl))
    roster = RosterFile(config.path(config.server.roster), revocations=revocations)
    members = MemberTrust(tls["ca"], roster, revocations)
    watch = ExpiryWatch(
        lambda: [*own, *roster_watch(roster.current())],
        within_days=config.server.renew_within_days,
        problems=lambda: _roster_problems(roster, revocations),
        logger=log,
    )
    identity = Identity(revocations)
    shared = Shared(
        identity=identity,
        members=members,
        roster=roster,
        certificate_pem=tls["certificate"],
        audit_key=derive_audit_key(key),
        sign=lambda blob: sign(key, blob, context=ROUNDSPEC_CONTEXT),
        echo=echo,
    )
    try:
        studies = Studies(config, shared, echo=echo)
    except BaseException:
        lock.release()
        raise
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="grpc"),
        interceptors=[CertificateGate(identity)],
        options=aggregator_options(config.timeouts.keepalive),
    )
    consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server(StudyRouter(studies), server)
    operator_pb2_grpc.add_OperatorServiceServicer_to_server(
        OperatorServicer(studies, identity, warnings=watch.warnings), server
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
        studies.close()
        lock.release()
        raise ConfigError("server.listen", [f"cannot listen on {config.server.listen}"])
    host = config.server.listen.rsplit(":", 1)[0]
    page = None
    try:
        page = _status_page(config, studies, revocations, watch)
        studies.start()  # the runs' drivers gather silos; a silo calling before the server starts retries
    except BaseException:
        if page is not None:
            page.stop()
        studies.halt()
        studies.close()
        lock.release()
        raise
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
    _stop_on_signals(stop)
    watch.check()
    threading.Thread(target=watch.run, args=(stop, WATCH_SECONDS), name="certificates", daemon=True).start()
    try:
        if config.consortium.exit_when_done:
            studies.wait_idle(stop)
            for line in [] if stop.is_set() else studies.idle_words():
                echo(line)
        else:
            stop.wait()
    finally:
        stop.set()
        health_servicer.enter_graceful_shutdown()
        studies.halt()
        if page is not None:
            page.stop()
        server.stop(grace=3).wait()
        studies.close()
        lock.release()
    return 1 if studies.failed else 0


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


def _status_page(
    config: ConsortiumConfig, studies: Studies, revocations: RevocationList, watch: ExpiryWatch
) -> StatusPage | None:
    if not config.server.status_page:
        return None
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
            lambda: studies.page(watch.warnings()),
            revocations,
            tls,
            token_file=token_file,
            names=names,
            connections=server.status_page_connections,
            metrics=lambda: exposition(
                ConsortiumCollector(
                    studies.facts(),
                    states=study_states(studies.list()),
                    certificate_warnings=len(watch.warnings()),
                )
            ),
        )
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise ConfigError("server.status_page", [f"cannot serve the status page: {exc}"]) from None
    return page.start()


def _stop_on_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
