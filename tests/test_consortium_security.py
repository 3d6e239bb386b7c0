"""A live aggregator against clients that are not who they claim, and silos that send what they should not.

The test itself plays the silo (or the intruder) over real mutual TLS, so every refusal is the one a network
peer would get, with its status code and message, and the store is checked to hold nothing from it.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from datetime import UTC, datetime, timedelta

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fedlt.aggregation.plaintext import upload_bytes
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, operator_pb2, operator_pb2_grpc, round_pb2
from fedlt.wire import schema_from_pb, submit_stream
from privacy.pki.ca import init_ca, issue_silo, revoke
from tests.consortium_harness import Consortium, channel, code_of, payload_server, read_all, register

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    consortium = Consortium.create(
        tmp_path_factory.mktemp("security"),
        rounds=1,
        min_silos=1,
        silos=1,
        round_timeout=120.0,
        privacy="plaintext",  # one silo plays a round by hand; a secure sum needs two
    )
    consortium.start_aggregator()
    yield consortium
    consortium.stop()


def test_client_without_certificate_is_refused(live):
    with channel(live, None) as ch:
        code, _ = code_of(lambda: register(ch))
    assert code == CODE.UNAVAILABLE  # the TLS handshake itself fails


def test_certificate_from_another_ca_is_refused(live, tmp_path):
    init_ca(tmp_path / "other", name="another consortium")
    issue_silo(tmp_path / "other", tmp_path, silo_id="silo-0")
    with channel(live, "silo-0", ca_dir=tmp_path) as ch:
        code, _ = code_of(lambda: register(ch))
    assert code == CODE.UNAVAILABLE


def test_expired_certificate_is_refused(live, tmp_path):
    past = datetime.now(UTC) - timedelta(days=400)
    live.enroll("old-silo", tmp_path, valid_from=past, days=30)
    with channel(live, "old-silo", ca_dir=tmp_path) as ch:
        code, _ = code_of(lambda: register(ch))
    assert code == CODE.UNAVAILABLE


def test_revoked_certificate_is_refused_without_restart(live, tmp_path):
    ca = live.directory / "pki" / "ca"
    live.enroll("leaving-silo", tmp_path)
    with channel(live, "leaving-silo", ca_dir=tmp_path) as ch:
        assert register(ch).silo_id == "leaving-silo"
        revoke(ca, silo_id="leaving-silo")
        code, details = code_of(lambda: register(ch))
    assert code == CODE.PERMISSION_DENIED
    assert "revoked" in details


def test_a_certificate_the_ca_issued_but_the_roster_does_not_name_is_no_member(live, tmp_path):
    """The operator holds the CA key: a Sybil it issues passes TLS, and is refused at registration."""
    issue_silo(live.directory / "pki" / "ca", tmp_path, silo_id="sybil")
    with channel(live, "sybil", ca_dir=tmp_path) as ch:
        code, details = code_of(lambda: register(ch))
    assert code == CODE.PERMISSION_DENIED
    assert "does not name this certificate" in details
    store = live.store()
    assert "sybil" not in store.silos()
    store.close()


def test_operator_certificate_is_not_a_silo_and_a_silo_is_not_the_operator(live):
    with channel(live, "operator") as ch:
        code, _ = code_of(lambda: register(ch))
        assert code == CODE.PERMISSION_DENIED
        status = operator_pb2_grpc.OperatorServiceStub(ch).Status(operator_pb2.StatusRequest(), timeout=10)
        assert status.consortium_id == "test-consortium"
    with channel(live, "silo-0") as ch:
        code, _ = code_of(
            lambda: operator_pb2_grpc.OperatorServiceStub(ch).Status(operator_pb2.StatusRequest(), timeout=10)
        )
        assert code == CODE.PERMISSION_DENIED


def test_health_and_reflection(live):
    with channel(live, "silo-0") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="fedlt.v1.ConsortiumService"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"fedlt.v1.ConsortiumService", "fedlt.v1.OperatorService", "grpc.health.v1.Health"} <= names


def test_bad_requests_get_precise_codes_and_change_nothing(live):
    """Runs last in this module: it plays silo-0 through one round, refusals first, then a valid upload."""
    with channel(live, "silo-0") as ch:
        stub = consortium_pb2_grpc.ConsortiumServiceStub(ch)
        code, _ = code_of(lambda: next(iter(stub.Join(pb.JoinRequest(), timeout=5))))
        assert code == CODE.FAILED_PRECONDITION  # join before register
        register(ch)
        directives: queue.Queue = queue.Queue()
        stream = stub.Join(pb.JoinRequest())
        threading.Thread(target=read_all, args=(stream, directives), daemon=True).start()
        signed = directives.get(timeout=60).round_spec
        spec = round_pb2.RoundSpec.FromString(signed.spec)
        size = sum(int(np.prod(f.shape)) for f in spec.schema.fields)
        assert upload_bytes(schema_from_pb(spec.schema)) == 4 * size  # FedAvg's fields travel as float32
        good = np.zeros(size, dtype="<f4")
        good[-1] = 5.0  # n = 5, delta = 0: a harmless, valid contribution
        nan = good.copy()
        nan[0] = np.nan

        def submit(parts):
            return stub.Submit(iter(parts), timeout=30)

        def header(round_id=spec.round_id, total=size * 4, digest=""):
            return pb.SubmitRequest(
                header=pb.SubmitHeader(
                    round_id=round_id,
                    kind=pb.CONTRIBUTION_KIND_PLAINTEXT,
                    total_bytes=total,
                    sha256=digest,
                    sum=pb.SECURE_SUM_CONTRIBUTION,
                )
            )

        cases = {
            "wrong round": (
                lambda: submit(
                    submit_stream(
                        "r9.a1.dead",
                        good.tobytes(),
                        kind=pb.CONTRIBUTION_KIND_PLAINTEXT,
                        purpose="contribution",
                    )
                ),
                CODE.FAILED_PRECONDITION,
                "no attempt",
            ),
            "fetch wrong round": (
                lambda: list(stub.FetchState(pb.FetchStateRequest(round_id="r0"), timeout=10)),
                CODE.FAILED_PRECONDITION,
                "no attempt",
            ),
            "chunk before header": (
                lambda: submit([pb.SubmitRequest(chunk=b"x")]),
                CODE.INVALID_ARGUMENT,
                "starts with a header",
            ),
            "wrong shape": (
                lambda: submit(
                    submit_stream(
                        spec.round_id,
                        good[:-1].tobytes(),
                        kind=pb.CONTRIBUTION_KIND_PLAINTEXT,
                        purpose="contribution",
                    )
                ),
                CODE.INVALID_ARGUMENT,
                "schema needs",
            ),
            "short upload": (
                lambda: submit([header(), pb.SubmitRequest(chunk=good.tobytes()[:64])]),
                CODE.INVALID_ARGUMENT,
                "received 64 of",
            ),
            "checksum": (
                lambda: submit([header(digest="0" * 64), pb.SubmitRequest(chunk=good.tobytes())]),
                CODE.INVALID_ARGUMENT,
                "SHA-256",
            ),
            "nan": (
                lambda: submit(
                    submit_stream(
                        spec.round_id,
                        nan.tobytes(),
                        kind=pb.CONTRIBUTION_KIND_PLAINTEXT,
                        purpose="contribution",
                    )
                ),
                CODE.INVALID_ARGUMENT,
                "non-finite",
            ),
            "oversized message": (
                lambda: submit([header(), pb.SubmitRequest(chunk=bytes(5 << 20))]),
                CODE.RESOURCE_EXHAUSTED,
                "",
            ),
            # another layer's message: read as the consortium's layer only, it is refused before any stage
            "secagg stage": (
                lambda: stub.AdvertiseKeys(
                    pb.AdvertiseKeysRequest(round_id=spec.round_id, sum=pb.SECURE_SUM_CONTRIBUTION),
                    timeout=10,
                ),
                CODE.INVALID_ARGUMENT,
                "the plaintext layer takes nothing through AdvertiseKeys",
            ),
        }
        for name, (call, expected, words) in cases.items():
            code, details = code_of(call)
            assert code == expected, (name, code, details)
            assert words in details, (name, details)
        store = live.store()
        assert "contribution_accepted" not in [r.event for r in store.audit_log()]
        assert store.latest_state().round == 0
        store.close()

        receipt = submit(
            submit_stream(
                spec.round_id, good.tobytes(), kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose="contribution"
            )
        )
        assert receipt.sha256 == hashlib.sha256(good.tobytes()).hexdigest()
    assert live.wait_aggregator(timeout=60) == 0
    store = live.store()
    store.verify_audit()
    assert [r.event for r in store.audit_log()].count("contribution_accepted") == 1
    assert store.latest_state().round == 1
    store.close()


def test_a_200_mb_model_streams_both_ways(tmp_path):
    payload = np.random.default_rng(0).bytes(200 * 2**20)
    with payload_server(tmp_path, payload) as stub:
        data = b"".join(p.data for p in stub.FetchState(pb.FetchStateRequest(round_id="r"), timeout=120))
        assert hashlib.sha256(data).digest() == hashlib.sha256(payload).digest()
        receipt = stub.Submit(
            submit_stream("r", payload, kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose="contribution"),
            timeout=120,
        )
    assert receipt.sha256 == hashlib.sha256(payload).hexdigest()
