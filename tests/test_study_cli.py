"""The operator's study commands end to end: `python -m aggregator study ...` and `status --study`, through
`main([...])`, over mutual TLS on 127.0.0.1 to the real OperatorServicer behind the certificate gate, before
a fake of the aggregator's studies whose states move by the catalog's rules (the real `Catalog` holds them).
"""

from __future__ import annotations

import socket
import tomllib
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.__main__ import main
from aggregator.catalog import (
    CANCELLABLE,
    PAUSABLE,
    RESUMABLE,
    BadStudy,
    Catalog,
    StudyInfo,
)
from aggregator.service import STUDY_FILE_BYTES, CertificateGate, Identity, OperatorServicer
from fedlt.studies import DEFAULT_STUDY, id_problems
from fedlt.v1 import operator_pb2, operator_pb2_grpc
from privacy.pki.ca import revoke
from privacy.pki.identity import RevocationList, load_certificate
from tests.consortium_harness import write_kit

STUDY = 'method = "creff"\nprivacy = "blind"\nrounds = 20\n'
SETTINGS = ("method", "privacy", "rounds")


class FakeStudies:
    """`aggregator.catalog.StudyControl` without runs: `max_studies` slots, a queue that starts the next
    study when one frees, and a study file of three settings. Every change is kept as (what, study, by)."""

    def __init__(self, path: Path, *, max_studies: int = 1) -> None:
        self.catalog = Catalog(path)
        self.max_studies = max_studies
        self.changes: list[tuple[str, str, str]] = []
        self._add(DEFAULT_STUDY, 'method = "fedavg"\nprivacy = "secagg"\nrounds = 10\n', is_default=True)

    def _add(self, study: str, study_toml: str, *, is_default: bool = False) -> None:
        try:
            settings = tomllib.loads(study_toml)
        except tomllib.TOMLDecodeError as exc:
            raise BadStudy([f"the study file is no TOML: {exc}"]) from None
        missing = [f"{name}: required" for name in SETTINGS if name not in settings]
        if missing:
            raise BadStudy(missing)
        self.catalog.add(study, study_toml, is_default=is_default, state=self._free_or_queued())
        progress = {"method": settings["method"], "privacy": settings["privacy"]}
        self.catalog.keep_progress(study, {**progress, "total_rounds": settings["rounds"]})

    def _free_or_queued(self) -> str:
        running = sum(s.state == "running" for s in self.catalog.studies())
        return "running" if running < self.max_studies else "queued"

    def _start_queued(self) -> None:
        for study in self.catalog.studies():
            if study.state == "queued" and self._free_or_queued() == "running":
                self.catalog.set_state(study.id, "running", allowed=("queued",))

    def create(self, study: str, study_toml: str, *, by: str) -> StudyInfo:
        self._add(study, study_toml)
        self.changes.append(("create", study, by))
        return self.catalog.info(study)

    def list(self) -> list[StudyInfo]:
        return self.catalog.studies()

    def pause(self, study: str, *, by: str) -> StudyInfo:
        self.catalog.set_state(study, "paused", allowed=PAUSABLE)
        self._start_queued()
        self.changes.append(("pause", study, by))
        return self.catalog.info(study)

    def resume(self, study: str, *, by: str) -> StudyInfo:
        self.catalog.set_state(study, "queued", allowed=RESUMABLE)
        self._start_queued()
        self.changes.append(("resume", study, by))
        return self.catalog.info(study)

    def cancel(self, study: str, *, by: str, reason: str) -> StudyInfo:
        self.catalog.set_state(study, "cancelled", reason, allowed=CANCELLABLE)
        self._start_queued()
        self.changes.append(("cancel", study, by))
        return self.catalog.info(study)

    def status(self, study: str) -> dict:
        info = self.catalog.info(study)
        return {
            "consortium_id": "test-consortium",
            "study": info.id,
            "method": info.method,
            "privacy": info.privacy,
            "committed_rounds": info.committed_rounds,
            "total_rounds": info.total_rounds,
            "round_id": "",
            "stage": "gathering" if info.state == "running" else info.state,
            "deadline_ms": 0,
            "participants": [],
            "submitted": [],
            "state_digest": "ab" * 32,
            "dp_enabled": False,
            "silos": [
                {"silo_id": "silo-0", "connected": True, "last_seen_unix_ms": 1, "activity": "idle"},
            ],
        }


@dataclass
class Aggregator:
    directory: Path
    address: str
    studies: FakeStudies | None  # None: nothing answers at `address`

    def run(self, capsys, *argv: str, who: str = "operator") -> tuple[int, str, str]:
        """`python -m aggregator <argv>` as `who` (a certificate in pki/): exit code, stdout, stderr."""
        pki = self.directory / "pki"
        code = main(
            [
                *argv,
                "--config",
                str(self.directory / "consortium.toml"),
                "--cert",
                str(pki / f"{who}.pem"),
                "--key",
                str(pki / f"{who}.key"),
                "--address",
                self.address,
            ]
        )
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    def channel(self, who: str = "operator") -> grpc.Channel:
        pki = self.directory / "pki"
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(pki / "ca" / "ca.pem").read_bytes(),
            private_key=(pki / f"{who}.key").read_bytes(),
            certificate_chain=(pki / f"{who}.pem").read_bytes(),
        )
        return grpc.secure_channel(self.address, credentials)


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kit")
    write_kit(directory, silos=2)
    return directory


@contextmanager
def _serve(directory: Path, studies: FakeStudies) -> Iterator[Aggregator]:
    """The real OperatorServicer behind the certificate gate, as `serve` runs it, on 127.0.0.1 port 0."""
    pki = directory / "pki"
    identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[CertificateGate(identity)])
    operator_pb2_grpc.add_OperatorServiceServicer_to_server(OperatorServicer(studies, identity), server)
    key_pair = ((pki / "aggregator.key").read_bytes(), (pki / "aggregator.pem").read_bytes())
    credentials = grpc.ssl_server_credentials(
        [key_pair], root_certificates=(pki / "ca" / "ca.pem").read_bytes(), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield Aggregator(directory, f"127.0.0.1:{port}", studies)
    finally:
        server.stop(0)
        studies.catalog.close()


@pytest.fixture
def aggregator(kit, tmp_path) -> Iterator[Aggregator]:
    with _serve(kit, FakeStudies(tmp_path / "studies.sqlite")) as serving:
        yield serving


@pytest.fixture
def plan(tmp_path) -> Path:
    path = tmp_path / "imaging.toml"
    path.write_text(STUDY)
    return path


def _rows(table: str) -> dict[str, str]:
    """A study's row by its id, without the header."""
    return {line.split()[0]: line for line in table.splitlines()[1:]}


# --- the commands, round trip ------------------------------------------------------------------------


def test_create_list_pause_resume_cancel_round_trip(aggregator, plan, capsys):
    """One slot: the default study runs, a created one queues, and takes the slot while the default is
    paused; every change is made in the operator certificate's name."""
    code, out, _ = aggregator.run(capsys, "study", "create", "--id", "imaging", "--plan", str(plan))
    assert code == 0
    assert out.strip() == "created study 'imaging', now queued (1st in line)"

    code, out, _ = aggregator.run(capsys, "study", "list")
    assert code == 0
    assert out.splitlines()[0].split() == ["study", "method", "over", "privacy", "rounds", "state"]
    rows = _rows(out)
    assert rows["main"].split() == ["main", "(default)", "fedavg", "over", "secagg", "0/10", "running"]
    assert rows["imaging"].split()[1:] == ["creff", "over", "blind", "0/20", "queued", "(1st", "in", "line)"]

    code, out, _ = aggregator.run(capsys, "study", "pause", "--id", "main")
    assert (code, out.strip()) == (0, "paused study 'main', now paused")
    assert aggregator.studies.catalog.info("imaging").state == "running"  # the slot went to the queue

    code, out, _ = aggregator.run(capsys, "study", "resume", "--id", "main")
    assert (code, out.strip()) == (0, "resumed study 'main', now queued (1st in line)")

    code, out, _ = aggregator.run(
        capsys, "study", "cancel", "--id", "imaging", "--reason", "superseded by imaging-2027"
    )
    assert (code, out.strip()) == (0, "cancelled study 'imaging', now cancelled: superseded by imaging-2027")

    code, out, _ = aggregator.run(capsys, "study", "list")
    rows = _rows(out)
    assert rows["main"].endswith("  running")
    assert rows["imaging"].endswith("  cancelled: superseded by imaging-2027")
    assert aggregator.studies.changes == [
        ("create", "imaging", "operator"),
        ("pause", "main", "operator"),
        ("resume", "main", "operator"),
        ("cancel", "imaging", "operator"),
    ]


def test_status_shows_the_study_asked_for_and_lists_every_study(aggregator, plan, capsys):
    aggregator.run(capsys, "study", "create", "--id", "imaging", "--plan", str(plan))

    code, out, _ = aggregator.run(capsys, "status")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "consortium 'test-consortium', study 'main': fedavg over secagg"
    assert lines[1].startswith("rounds committed: 0/10")
    assert lines[lines.index("studies:") + 2].split()[:2] == ["main", "(default)"]

    code, out, _ = aggregator.run(capsys, "status", "--study", "imaging")
    assert code == 0
    assert out.splitlines()[0] == "consortium 'test-consortium', study 'imaging': creff over blind"
    assert "rounds committed: 0/20   stage: queued" in out
    assert "  imaging  " in out.split("studies:")[1]


def test_a_reason_or_error_text_reaches_the_terminal_as_one_printable_line(aggregator, capsys):
    """A failed study's reason is the error it stopped on, as the aggregator wrote it: no escape sequences
    reach the operator's terminal, and the table keeps one row a study."""
    aggregator.studies.catalog.set_state(DEFAULT_STUDY, "failed", "boom\n\x1b[2Jcleared")
    code, out, _ = aggregator.run(capsys, "study", "list")
    assert code == 0
    assert _rows(out)["main"].endswith("  failed: boom??[2Jcleared")
    assert "\x1b" not in out


# --- who may: an operator certificate, unrevoked ------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("study", "create", "--id", "imaging"),
        ("study", "list"),
        ("study", "pause", "--id", "main"),
        ("study", "resume", "--id", "main"),
        ("study", "cancel", "--id", "main"),
        ("status",),
    ],
    ids=lambda argv: argv[1] if len(argv) > 1 else argv[0],
)
def test_a_silo_certificate_cannot_run_the_operators_commands(aggregator, plan, capsys, argv):
    """A member silo (a valid consortium certificate) tries to cancel, pause or create studies, or read
    their state: each call is refused for the certificate, and nothing changes."""
    argv = (*argv, "--plan", str(plan)) if "create" in argv else argv
    before = aggregator.studies.list()
    code, out, err = aggregator.run(capsys, *argv, who="silo-0")
    assert code == 1
    assert out == ""
    assert f"error: {aggregator.address} refused this certificate:" in err
    assert "names fedlt://silo/silo-0" in err
    assert "need an operator certificate (python -m aggregator ca issue-operator)" in err
    assert aggregator.studies.list() == before
    assert aggregator.studies.changes == []


def test_a_revoked_operator_certificate_cannot_cancel_a_study(tmp_path, capsys):
    """The operator's certificate leaked and the CA revoked it: whoever holds it is refused by the gate."""
    write_kit(tmp_path, silos=2)
    pki = tmp_path / "pki"
    revoke(pki / "ca", serial=load_certificate((pki / "operator.pem").read_bytes()).serial_number)
    with _serve(tmp_path, FakeStudies(tmp_path / "studies.sqlite")) as aggregator:
        code, _, err = aggregator.run(capsys, "study", "cancel", "--id", "main")
        assert code == 1
        assert "refused this certificate: this certificate has been revoked" in err
        assert aggregator.studies.catalog.info("main").state == "running"


# --- every refusal, one clear line and exit 1 ---------------------------------------------------------


def test_an_unknown_study_is_not_found(aggregator, capsys):
    for argv in (("study", "pause", "--id", "nope"), ("status", "--study", "nope")):
        code, _, err = aggregator.run(capsys, *argv)
        assert code == 1
        assert err == f"error: {aggregator.address}: NOT_FOUND: no study 'nope' on this aggregator\n"


def test_a_taken_id_already_exists(aggregator, plan, capsys):
    code, _, err = aggregator.run(capsys, "study", "create", "--id", "main", "--plan", str(plan))
    assert code == 1
    assert err == (
        f"error: {aggregator.address}: ALREADY_EXISTS: a study 'main' exists already; ids are never reused\n"
    )


def test_a_request_in_the_wrong_state_fails_its_precondition(aggregator, capsys):
    code, _, err = aggregator.run(capsys, "study", "resume", "--id", "main")
    assert code == 1
    assert err == f"error: {aggregator.address}: FAILED_PRECONDITION: study 'main' is running\n"
    aggregator.run(capsys, "study", "cancel", "--id", "main")
    code, _, err = aggregator.run(capsys, "study", "pause", "--id", "main")
    assert err == f"error: {aggregator.address}: FAILED_PRECONDITION: study 'main' is cancelled\n"


def test_a_study_files_problems_come_back_one_a_line(aggregator, tmp_path, capsys):
    plan = tmp_path / "half.toml"
    plan.write_text('method = "fedavg"\n')
    code, out, err = aggregator.run(capsys, "study", "create", "--id", "half", "--plan", str(plan))
    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        f"error: {aggregator.address}: INVALID_ARGUMENT: the study file has problems:",
        "  privacy: required",
        "  rounds: required",
    ]
    assert [s.id for s in aggregator.studies.list()] == ["main"]


def test_a_study_file_over_a_mebibyte_is_refused_by_the_aggregator(aggregator, tmp_path, capsys):
    plan = tmp_path / "huge.toml"
    plan.write_text(STUDY + "#" * STUDY_FILE_BYTES)
    code, _, err = aggregator.run(capsys, "study", "create", "--id", "huge", "--plan", str(plan))
    assert code == 1
    assert err == (
        f"error: {aggregator.address}: INVALID_ARGUMENT: a study request the aggregator cannot take: "
        f"study_toml: {STUDY_FILE_BYTES + len(STUDY):,} bytes; a study file is at most {STUDY_FILE_BYTES:,}\n"
    )
    assert aggregator.studies.changes == []


def test_a_cancel_reason_is_one_short_printable_line(aggregator, capsys):
    for reason, problem in (
        ("two\nlines", "not one printable line"),
        ("x" * 513, "513 characters; at most 512"),
    ):
        code, _, err = aggregator.run(capsys, "study", "cancel", "--id", "main", "--reason", reason)
        assert code == 1
        assert err == (
            f"error: {aggregator.address}: INVALID_ARGUMENT: a study request the aggregator cannot take: "
            f"reason: {problem}\n"
        )
    assert aggregator.studies.changes == []


def test_no_aggregator_answering_is_said_so(kit, capsys, unused_port):
    aggregator = Aggregator(kit, f"127.0.0.1:{unused_port}", studies=None)
    code, _, err = aggregator.run(capsys, "study", "list")
    assert code == 1
    assert f"error: no aggregator answers at 127.0.0.1:{unused_port}: is it running?" in err


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as closed:  # a port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        return closed.getsockname()[1]


# --- the operator's own mistakes: said before dialling, exit 2 -----------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("study", "pause", "--id", "Imaging"), "--id: a study id is 1 to 40 lower-case letters"),
        (("study", "create", "--id", "x", "--plan", "no-such.toml"), "--plan no-such.toml: no such file"),
    ],
)
def test_an_operators_mistake_is_one_line_and_exit_2(aggregator, capsys, argv, message):
    code, _, err = aggregator.run(capsys, *argv)
    assert code == 2
    assert err.startswith(f"error: {message}")
    assert len(err.splitlines()) == 1


def test_a_study_file_that_is_not_text_is_said_so(aggregator, tmp_path, capsys):
    plan = tmp_path / "weights.toml"
    plan.write_bytes(b"method = \xff\n")
    code, _, err = aggregator.run(capsys, "study", "create", "--id", "x", "--plan", str(plan))
    assert code == 2
    assert err == f"error: --plan {plan}: not UTF-8 text (invalid start byte at byte 9)\n"


def test_a_missing_certificate_file_is_named(aggregator, tmp_path, capsys):
    code, _, err = aggregator.run(capsys, "study", "list", who="nobody")
    assert code == 2
    assert err.startswith(f"error: --key {aggregator.directory / 'pki' / 'nobody.key'}: no such file")


# --- the service's own checks, whatever the client ---------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(study=st.text(max_size=60).filter(lambda s: bool(id_problems(s, "id"))))
def test_an_id_no_study_can_have_never_reaches_the_studies(aggregator, study):
    """Ids name folders and routing labels: a call naming anything else (`../x`, upper case, control
    characters, too long) is refused where it enters, so the studies never see it."""
    with aggregator.channel() as channel:
        stub = operator_pb2_grpc.OperatorServiceStub(channel)
        for call in (
            lambda: stub.CreateStudy(operator_pb2.CreateStudyRequest(id=study, study_toml=STUDY), timeout=30),
            lambda: stub.PauseStudy(operator_pb2.PauseStudyRequest(id=study), timeout=30),
            lambda: stub.ResumeStudy(operator_pb2.ResumeStudyRequest(id=study), timeout=30),
            lambda: stub.CancelStudy(operator_pb2.CancelStudyRequest(id=study), timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "a study id is" in refused.value.details()
    assert aggregator.studies.changes == []
