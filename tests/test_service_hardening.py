"""Requests a well-behaved silo never sends, and callers the gRPC side services used to let through.

Each test mounts one misbehaviour (an enum number the schema does not define, a registration full of
made-up values, a Submit stream of empty chunks or one that never ends, a revoked certificate probing health
and reflection) and checks the precise status code, a message naming the problem, and that nothing was kept.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from aggregator.service import CertificateGate, ConsortiumServicer, Identity
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.pki.ca import init_ca, issue_server, issue_silo, revoke
from privacy.pki.identity import RevocationList
from tests.consortium_harness import Consortium, PayloadEngine, channel, code_of, no_members

CODE = grpc.StatusCode
SUBMIT_SECONDS = 3.0  # the test servicer's bound on one Submit stream


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    consortium = Consortium.create(
        tmp_path_factory.mktemp("hardening"),
        rounds=1,
        min_silos=1,
        silos=1,
        round_timeout=120.0,
        privacy="plaintext",
    )
    consortium.start_aggregator()
    yield consortium
    consortium.stop()


def _newcomer(live: Consortium, directory: Path, silo_id: str) -> grpc.Channel:
    """A channel as a freshly enrolled silo, so each test starts from a silo the store has never seen."""
    live.enroll(silo_id, directory)
    return channel(live, silo_id, ca_dir=directory)


# --- 1. enum numbers the schema does not define ------------------------------------------------------


def _header(**fields) -> pb.SubmitRequest:
    return pb.SubmitRequest(header=pb.SubmitHeader(round_id="r1.a1.x", total_bytes=8, **fields))


UNKNOWN_ENUMS = {
    "HeartbeatRequest.activity": lambda stub: stub.Heartbeat(pb.HeartbeatRequest(activity=99), timeout=10),
    "SubmitRequest.header.kind": lambda stub: stub.Submit(iter([_header(kind=99)]), timeout=10),
    "SubmitRequest.header.sum": lambda stub: stub.Submit(
        iter([_header(kind=pb.CONTRIBUTION_KIND_PLAINTEXT, sum=77)]), timeout=10
    ),
    "AdvertiseKeysRequest.sum": lambda stub: stub.AdvertiseKeys(pb.AdvertiseKeysRequest(sum=99), timeout=10),
    "ShareKeysRequest.sum": lambda stub: stub.ShareKeys(pb.ShareKeysRequest(sum=99), timeout=10),
    "ConsistencyRequest.sum": lambda stub: stub.Consistency(pb.ConsistencyRequest(sum=99), timeout=10),
    "UnmaskRequest.sum": lambda stub: stub.Unmask(pb.UnmaskRequest(sum=99), timeout=10),
}


@pytest.mark.parametrize("field", UNKNOWN_ENUMS)
def test_an_unknown_enum_number_is_refused_naming_its_field(live, field):
    with channel(live, "silo-0") as ch:
        code, details = code_of(lambda: UNKNOWN_ENUMS[field](consortium_pb2_grpc.ConsortiumServiceStub(ch)))
    assert code == CODE.INVALID_ARGUMENT, details
    assert field in details
    assert "internal error" not in details


# --- 2. registrations with values no silo policy can hold --------------------------------------------

GOOD = {"agent_version": "fedlt-silo/0.1", "accepted_methods": ["fedavg"], "accepted_privacy": ["plaintext"]}
BAD_REGISTRATIONS = {
    "no version": ({"agent_version": ""}, ["agent_version: empty"]),
    "long version": ({"agent_version": "v" * 65}, ["agent_version: 65 characters"]),
    "control characters": ({"agent_version": "v1\n\x1b[2J"}, ["agent_version: not printable"]),
    "unknown method": ({"accepted_methods": ["fedavg", "steal-gradients"]}, ["'steal-gradients'"]),
    "unimplemented layer": ({"accepted_privacy": ["paillier"]}, ["accepted_privacy: unknown 'paillier'"]),
    "unknown disclosure": ({"accepted_disclosures": ["raw-data"]}, ["accepted_disclosures: unknown"]),
    "duplicates": (
        {"accepted_methods": ["fedavg", "fedavg"]},
        ["accepted_methods: repeats 'fedavg' 2 times"],
    ),
    "endless list": (
        {"accepted_privacy": ["plaintext"] * 10_000},
        ["accepted_privacy: repeats 'plaintext' 10000 times"],
    ),
    "endless made-up list": (
        {"accepted_methods": [f"method-{i}" for i in range(10_000)]},
        ["unknown 'method-0', 'method-1', 'method-2' and 9997 more"],
    ),
    "everything at once": (
        {"agent_version": "", "accepted_methods": ["x"], "accepted_disclosures": ["mfsc", "mfsc"]},
        [
            "agent_version: empty",
            "accepted_methods: unknown 'x'",
            "accepted_disclosures: repeats 'mfsc' 2 times",
        ],
    ),
}


@pytest.mark.parametrize("case", BAD_REGISTRATIONS)
def test_a_registration_with_made_up_values_is_refused_and_not_stored(live, tmp_path, case):
    fields, phrases = BAD_REGISTRATIONS[case]
    silo_id = "newcomer-" + case.replace(" ", "-")
    with _newcomer(live, tmp_path, silo_id) as ch:
        code, details = code_of(
            lambda: consortium_pb2_grpc.ConsortiumServiceStub(ch).Register(
                pb.RegisterRequest(**{**GOOD, **fields}), timeout=10
            )
        )
    assert code == CODE.INVALID_ARGUMENT, details
    for phrase in phrases:
        assert phrase in details
    assert len(details) < 2000  # a huge request does not echo itself back
    store = live.store()
    try:
        assert silo_id not in store.silos()
        assert silo_id not in str([r.detail for r in store.audit_log()])
    finally:
        store.close()


def test_a_well_formed_registration_is_kept(live, tmp_path):
    request = pb.RegisterRequest(**GOOD, accepted_disclosures=["mfsc"])
    with _newcomer(live, tmp_path, "well-formed") as ch:
        reply = consortium_pb2_grpc.ConsortiumServiceStub(ch).Register(request, timeout=10)
    assert reply.silo_id == "well-formed"
    store = live.store()
    try:
        assert store.policy("well-formed") == {
            "methods": ["fedavg"],
            "privacy": ["plaintext"],
            "disclosures": ["mfsc"],
        }
    finally:
        store.close()


# --- 3. Submit streams that never end ----------------------------------------------------------------


class RecordingInbox(PayloadEngine):
    """Takes one payload size and remembers every contribution the servicer hands on."""

    def __init__(self, payload: bytes) -> None:
        super().__init__(payload)
        self.accepted: list[str] = []

    def upload(self, silo_id: str, round_id: str, purpose: str, message: object, digest: str) -> str:
        self.accepted.append(digest)
        return digest


@contextmanager
def _tls_server(
    directory: Path, add, *, require_client_auth: bool = True, gated: bool = False, workers: int = 4
) -> Iterator[tuple[int, bytes]]:
    """A gRPC server over TLS on 127.0.0.1 with this directory's CA; yields its port and the CA's PEM."""
    init_ca(directory / "ca", name="hardening CA")
    issue_server(directory / "ca", directory, hosts=["127.0.0.1"])
    identity = Identity(RevocationList.load(directory / "ca" / "ca.pem", directory / "ca" / "crl.pem"))
    interceptors = [CertificateGate(identity)] if gated else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors)
    add(server, identity)
    ca = (directory / "ca" / "ca.pem").read_bytes()
    key_pair = ((directory / "aggregator.key").read_bytes(), (directory / "aggregator.pem").read_bytes())
    credentials = grpc.ssl_server_credentials(
        [key_pair], root_certificates=ca, require_client_auth=require_client_auth
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port, ca
    finally:
        server.stop(0)


PAYLOAD = bytes(range(16))  # two float64 values


@contextmanager
def _submit_server(directory: Path, *, seconds: float, workers: int = 4) -> Iterator[tuple]:
    """A Submit stub as silo-0 to the real servicer, bounded to `seconds`, and the inbox behind it."""
    inbox = RecordingInbox(PAYLOAD)

    def add(server, identity):
        servicer = ConsortiumServicer(
            inbox, None, identity, b"", **no_members(directory, identity), submit_seconds=seconds
        )
        consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server(servicer, server)

    with _tls_server(directory, add, workers=workers) as (port, ca):
        issue_silo(directory / "ca", directory, silo_id="silo-0")
        client = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(directory / "silo-0.key").read_bytes(),
            certificate_chain=(directory / "silo-0.pem").read_bytes(),
        )
        with grpc.secure_channel(f"127.0.0.1:{port}", client) as ch:
            yield consortium_pb2_grpc.ConsortiumServiceStub(ch).Submit, inbox


@pytest.fixture
def submit(tmp_path):
    with _submit_server(tmp_path, seconds=SUBMIT_SECONDS) as call_and_inbox:
        yield call_and_inbox


def _plaintext_header() -> pb.SubmitRequest:
    return pb.SubmitRequest(
        header=pb.SubmitHeader(
            round_id="r",
            kind=pb.CONTRIBUTION_KIND_PLAINTEXT,
            total_bytes=len(PAYLOAD),
            sha256=hashlib.sha256(PAYLOAD).hexdigest(),
            sum=pb.SECURE_SUM_CONTRIBUTION,
        )
    )


def test_an_empty_chunk_is_refused(submit):
    call, inbox = submit

    def endless_empty_chunks():
        yield _plaintext_header()
        for _ in range(100_000):
            yield pb.SubmitRequest(chunk=b"")

    code, details = code_of(lambda: call(endless_empty_chunks(), timeout=30))
    assert code == CODE.INVALID_ARGUMENT
    assert "empty chunk" in details
    assert inbox.accepted == []


def test_a_submit_that_stalls_after_its_header_ends_at_the_servers_bound(submit):
    call, inbox = submit
    released = threading.Event()

    def stalled():
        yield _plaintext_header()
        released.wait(60)  # the client would hold the stream open for a minute

    started = time.monotonic()
    try:
        code, details = code_of(lambda: call(stalled(), timeout=60))
    finally:
        released.set()
    assert code == CODE.DEADLINE_EXCEEDED, details
    assert SUBMIT_SECONDS <= time.monotonic() - started < 30
    assert f"{SUBMIT_SECONDS:g} s" in details
    assert inbox.accepted == []
    for reader in [t for t in threading.enumerate() if t.name == "client-stream"]:
        reader.join(timeout=10)  # the thread that read the stalled stream ends with the RPC
        assert not reader.is_alive()


def test_a_submit_that_trickles_bytes_ends_at_the_servers_bound(submit):
    """Each byte arrives well within the bound; the whole stream does not."""
    call, inbox = submit
    released = threading.Event()

    def trickle():
        yield _plaintext_header()
        for byte in PAYLOAD:
            if released.wait(1.0):
                return
            yield pb.SubmitRequest(chunk=bytes([byte]))

    try:
        code, _ = code_of(lambda: call(trickle(), timeout=60))
    finally:
        released.set()
    assert code == CODE.DEADLINE_EXCEEDED
    assert inbox.accepted == []


def test_a_stream_grpc_cuts_off_frees_its_worker_at_once(tmp_path):
    """An oversized message ends the RPC inside gRPC; the handler must notice, not hold the only worker until
    its bound, while the next upload waits."""
    with _submit_server(tmp_path, seconds=120.0, workers=1) as (call, inbox):
        oversized = [_plaintext_header(), pb.SubmitRequest(chunk=bytes(5 << 20))]
        code, _ = code_of(lambda: call(iter(oversized), timeout=30))
        assert code == CODE.RESOURCE_EXHAUSTED
        receipt = call(iter([_plaintext_header(), pb.SubmitRequest(chunk=PAYLOAD)]), timeout=20)
    assert inbox.accepted == [receipt.sha256]


def test_a_prompt_submit_is_accepted(submit):
    call, inbox = submit
    parts = [_plaintext_header(), pb.SubmitRequest(chunk=PAYLOAD[:4]), pb.SubmitRequest(chunk=PAYLOAD[4:])]
    receipt = call(iter(parts), timeout=30)
    assert inbox.accepted == [receipt.sha256] == [hashlib.sha256(PAYLOAD).hexdigest()]


# --- 4. health and reflection behind the same certificate check as every fedlt RPC -------------------


def _probes(ch: grpc.Channel) -> dict:
    health_stub = health_pb2_grpc.HealthStub(ch)
    request = health_pb2.HealthCheckRequest(service="fedlt.v1.ConsortiumService")
    reflect = reflection_pb2.ServerReflectionRequest(list_services="")
    return {
        "health check": lambda: health_stub.Check(request, timeout=10),
        "health watch": lambda: next(iter(health_stub.Watch(request, timeout=10))),
        "reflection": lambda: list(
            reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([reflect]), timeout=10)
        ),
        "register": lambda: consortium_pb2_grpc.ConsortiumServiceStub(ch).Register(
            pb.RegisterRequest(**GOOD), timeout=10
        ),
    }


def test_a_revoked_silo_cannot_probe_health_or_reflection(live, tmp_path):
    with _newcomer(live, tmp_path, "revoked-prober") as ch:
        for probe in _probes(ch).values():
            probe()  # answered while the certificate is good
        revoke(live.directory / "pki" / "ca", silo_id="revoked-prober")
        for name, probe in _probes(ch).items():
            code, details = code_of(probe)
            assert code == CODE.PERMISSION_DENIED, (name, code, details)
            assert "revoked" in details, name


def test_a_caller_without_a_certificate_is_refused_by_the_gate(tmp_path):
    """Mutual TLS already stops such a caller; the gate refuses it too, should a listener ever let one in."""

    def add(server, identity):
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)

    with _tls_server(tmp_path, add, require_client_auth=False, gated=True) as (port, ca):
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as ch:
            code, details = code_of(
                lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            )
    assert code == CODE.UNAUTHENTICATED
    assert "certificate is required" in details
