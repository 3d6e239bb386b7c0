"""One silo in several studies (issue 35): silo.toml's `[study.<id>]` tables, one agent process per study
under a supervisor, the state directory shared where the silo keeps one thing across studies (both ledgers,
the pinned roster, the mask secret) and one folder per study for the rest, the study header on every call,
and an agent that waits, saying so once, while the aggregator does not take its study.

The release gate's keys across studies (the data, never the study's label) are in tests/test_release_gate.py;
a real run of two studies against one aggregator is tests/test_consortium.py's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from aggregator.demo import point_silos_at
from fedlt.aggregation.gate import RepeatedRelease, Subject
from fedlt.aggregation.halves import SiloHalf, SiloSide, SumSpec
from fedlt.aggregation.schema import Field, Schema
from fedlt.dir_lock import DirectoryBusy
from fedlt.errors import ConfigError
from fedlt.studies import STUDY_HEADER
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.dp import BudgetExceeded
from privacy.dp.accountant import ORDERS
from silo.__main__ import main
from silo.agent import SiloAgent
from silo.config import load_silo_config
from silo.releases import LEDGER, LedgerMissing, check_ledgers
from silo.studies import Supervisor, note_single_run
from silo.transport import study_channel
from tests.consortium_harness import ENV, write_kit

WAIT = 120  # seconds: generous bounds for a busy machine; each wait ends as soon as its event happens

# ---------------------------------------------------------------- silo.toml's [study.<id>] tables

GOOD = """
state_dir = "state"

[data]
path = "admissions.csv"

[policy]
min_participants = 4
methods = ["fedavg", "fedprox"]

[study.readmission]

[study.imaging.data]
path = "images"
format = "folder"

[study.imaging.policy]
min_survivors = 4
methods = ["fedavg"]

[study.imaging.monitoring]
prometheus = "127.0.0.1:9466"
"""


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "silo.toml"
    path.write_text(text)
    return path


def test_a_study_table_replaces_data_and_monitoring_and_overrides_only_the_policy_keys_it_sets(tmp_path):
    config = load_silo_config(written(tmp_path, GOOD))
    assert config.study_ids == ("readmission", "imaging")
    imaging, readmission = config.for_study("imaging"), config.for_study("readmission")
    assert (imaging.data.path, imaging.data.format) == ("images", "folder")
    assert imaging.evaluation == config.evaluation  # not given: the top-level one
    assert imaging.policy.min_survivors == 4
    assert imaging.policy.methods == ("fedavg",)
    assert imaging.policy.min_participants == 4  # not set in the study's table: [policy]'s
    assert imaging.policy.threshold_above == config.policy.threshold_above
    assert imaging.monitoring.prometheus == "127.0.0.1:9466"
    assert readmission.data == config.data
    assert readmission.policy == config.policy
    assert not readmission.monitoring.prometheus
    # each study's own folder; the silo's one directory for what its studies share
    assert imaging.path(imaging.state_dir) == tmp_path / "state" / "studies" / "imaging"
    assert imaging.shared_dir() == readmission.shared_dir() == config.shared_dir() == tmp_path / "state"
    assert (imaging.study, config.study) == ("imaging", "")
    with pytest.raises(ConfigError, match="names no study 'genomics'; its studies: readmission, imaging"):
        config.for_study("genomics")


def test_without_study_tables_the_agent_is_the_default_studys_with_every_file_where_it_was(tmp_path):
    config = load_silo_config(written(tmp_path, 'state_dir = "state"\n[data]\npath = "a.csv"\n'))
    assert config.studies == ()
    assert config.study == ""
    assert config.path(config.state_dir) == config.shared_dir() == tmp_path / "state"
    with pytest.raises(ConfigError, match="names no study 'a'; its studies: none"):
        config.for_study("a")


BAD = """
studies = ["x"]

[monitoring]
prometheus = "127.0.0.1:9465"

[data]
path = "admissions.csv"

[study.Imaging]

[study.a.dta]
path = "x"

[study.a.dp]
epsilon = 1.0

[study.a.policy]
roster_quorum_above = "2/3"
min_participant = 2

[study.b.data]
source = "files"

[study.b.policy]
min_survivors = 9

[study.b.monitoring]
prometheus = "127.0.0.1:9470"

[study.c.monitoring]
prometheus = "127.0.0.1:9470"
"""


def test_every_problem_of_the_study_tables_is_named_at_once(tmp_path, capsys):
    with pytest.raises(ConfigError) as raised:
        load_silo_config(written(tmp_path, BAD))
    expected = [
        "studies: unknown setting",
        "monitoring.prometheus: with [study.<id>] tables each study's agent runs as a process of its own",
        "study.Imaging: a study id is 1 to 40 lower-case letters",
        "study.a.dta: unknown setting (did you mean 'data'?)",
        "study.a.dp: not a study's own setting: the silo has one privacy budget and one ledger",
        "study.a.policy.roster_quorum_above: not a study's own setting: the pinned roster is the silo's one",
        "study.a.policy.min_participant: unknown setting (did you mean 'min_participants'?)",
        "study.b.data.path: required when data.source = 'files'",
        "study.b.policy.min_survivors: 9 is more than policy.min_participants 3",
        "study.c.monitoring.prometheus: 127.0.0.1:9470 is study 'b''s too",
    ]
    for problem in expected:
        assert any(p.startswith(problem) for p in raised.value.problems), (problem, raised.value.problems)
    assert len(raised.value.problems) == len(expected)
    # the command line says the same, exit 2, and starts nothing
    assert main(["run", "--config", str(tmp_path / "silo.toml")]) == 2
    assert "study.a.dta: unknown setting" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("study = 3\n", "study: expected one [study.<id>] table per study, such as [study.readmission]"),
        ("[study]\n", "study: expected one [study.<id>] table per study"),
        ("[study]\nimaging = 1\n", "study.imaging: expected a table, such as [study.imaging.data]"),
        ("[study.a.policy]\nmethods = 'fedavg'\n", "study.a.policy.methods: expected a list of str"),
        (
            "[study.a.monitoring]\nprometheus = '0.0.0.0:9465'\n",
            "study.a.monitoring.prometheus: 0.0.0.0 is not",
        ),
    ],
)
def test_malformed_study_tables_are_refused_saying_how(tmp_path, text, problem):
    with pytest.raises(ConfigError) as raised:
        load_silo_config(written(tmp_path, f'{text}\n[data]\npath = "a.csv"\n'))
    assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


def test_study_commands_say_which_study_where_silo_toml_names_several(tmp_path, capsys):
    path = written(tmp_path, GOOD)
    assert main(["keys", "rotate", "--config", str(path)]) == 2
    assert "silo.toml names studies (readmission, imaging): say which study's with" in capsys.readouterr().err
    assert main(["export", "--config", str(path), "--out", str(tmp_path / "out"), "--study", "x"]) == 2
    assert "names no study 'x'; its studies: readmission, imaging" in capsys.readouterr().err
    single = written(tmp_path, '[data]\npath = "a.csv"\n')
    assert main(["run", "--config", str(single), "--study", "imaging"]) == 2
    assert "silo.toml names no studies ([study.<id>] tables)" in capsys.readouterr().err


def test_a_silo_whose_every_study_has_its_own_data_needs_no_top_level_data(tmp_path):
    text = '[study.a.data]\npath = "a.csv"\n\n[study.b.data]\npath = "b.csv"\n'
    assert load_silo_config(written(tmp_path, text)).for_study("b").data.path == "b.csv"
    with pytest.raises(ConfigError, match=r"data\.path: required when data\.source = 'files'"):
        load_silo_config(written(tmp_path, text + "\n[study.c]\n"))  # c trains on [data], which names none


def test_the_guides_several_studies_example_reads_as_it_says(tmp_path):
    guide = (Path(__file__).parent.parent / "docs" / "operator.md").read_text()
    (example,) = [b for b in re.findall(r"```toml\n(.*?)```", guide, re.S) if "[study.main]" in b]
    config = load_silo_config(written(tmp_path, example))
    assert config.study_ids == ("main", "imaging-2026")
    main_study, imaging = config.for_study("main"), config.for_study("imaging-2026")
    assert (main_study.data, main_study.policy) == (config.data, config.policy)
    assert imaging.data.path == "/data/xray-train"
    assert (imaging.policy.methods, imaging.policy.min_survivors) == (("fedprox",), 4)
    assert imaging.policy.min_participants == 4
    assert imaging.monitoring.prometheus == "127.0.0.1:9466"


# ---------------------------------------------------------------- the state directory's layout


def kit(tmp_path: Path, *studies: str, silos: int = 3) -> Path:
    """Silo 0's config of a kit of `silos` silos, with a [study.<id>] table for each of `studies`."""
    path = write_kit(tmp_path, silos=silos, consortium_id="c")[0]
    path.write_text(path.read_text() + "".join(f"\n[study.{study}]\n" for study in studies))
    return path


@contextmanager
def agents(config, *studies: str) -> Iterator[list[SiloAgent]]:
    """One agent per study (`config` itself for ""), their locks released at the end."""
    made = []
    try:
        for study in studies:
            made.append(SiloAgent(config.for_study(study) if study else config))
        yield made
    finally:
        for agent in made:
            agent.state_lock.release()
            if agent.shared_hold is not None:
                agent.shared_hold.release()


def test_studies_share_the_ledgers_and_roster_and_keep_their_own_progress_keys_and_lock(tmp_path):
    config = load_silo_config(kit(tmp_path, "readmission", "imaging"))
    root = tmp_path / "silo-0-state"
    with agents(config, "readmission", "imaging") as (readmission, imaging):
        assert readmission.state_dir == root / "studies" / "readmission"
        assert imaging.state_dir == root / "studies" / "imaging"
        for shared in ("releases.json", "privacy-ledger.json", "roster.json"):
            assert (root / shared).exists(), shared
        assert readmission.ledger.path == imaging.ledger.path == root / "releases.json"
        assert readmission.privacy_ledger.path == imaging.privacy_ledger.path == root / "privacy-ledger.json"
        assert readmission.work.mask_secret() == imaging.work.mask_secret()  # made once, for the silo
        assert (root / "mask.secret").exists()
        for agent in (readmission, imaging):
            assert (agent.state_dir / "agent.lock").exists()
            assert agent.progress._path == agent.state_dir / "progress.json"
            assert agent.pending._bin.parent == agent.state_dir
        with pytest.raises(DirectoryBusy, match="studies/imaging is in use by another silo agent"):
            SiloAgent(config.for_study("imaging"))  # one agent per study
        with pytest.raises(DirectoryBusy, match="silo-0-state is in use by another silo agent"):
            SiloAgent(replace(config, studies=()))  # an agent without studies on the same directory


def test_an_agent_without_studies_keeps_the_study_agents_off_its_directory(tmp_path):
    config = load_silo_config(kit(tmp_path, "imaging"))
    with agents(replace(config, studies=()), ""), pytest.raises(DirectoryBusy, match="without studies"):
        SiloAgent(config.for_study("imaging"))


def test_two_studies_agents_together_cannot_pass_the_budget_or_release_one_subject_twice(tmp_path):
    """The attack: a study that spends or releases as if the silo's other studies had not (two agents, each
    its own ledger objects). Both ledgers are the silo's files, locked and re-read at every write: the second
    study's charge is refused once the first's spent the budget, and its release of the same data from the
    same state over another silo set is refused."""
    config = load_silo_config(kit(tmp_path, "readmission", "imaging", silos=4))
    half = np.full(len(ORDERS), 0.6 * config.dp.epsilon)  # one fits the budget, two do not
    with agents(config, "readmission", "imaging") as (readmission, imaging):
        readmission.privacy_ledger.charge("gaussian", half, what="readmission's round 1")
        with pytest.raises(BudgetExceeded, match="past its budget"):
            imaging.privacy_ledger.charge("gaussian", half, what="imaging's round 1")
        assert len(imaging.privacy_ledger.entries) == 1  # readmission's, read at its charge
        subject = Subject("contribution", b"the same state", "the same data")
        three, four = ("silo-0", "silo-1", "silo-2"), ("silo-0", "silo-1", "silo-2", "silo-3")
        readmission.admission.gate.release(sum_spec(four), Opaque(), three, subject)
        with pytest.raises(RepeatedRelease, match="would let the aggregator subtract the two sums"):
            imaging.admission.gate.release(sum_spec(four), Opaque(), four, subject)
        other = Subject("contribution", b"the same state", "imaging's own data")
        imaging.admission.gate.release(sum_spec(four), Opaque(), four, other)


class Opaque(SiloSide):
    """A layer side that hides inputs and asks for nothing of its own (the gate's checks are the point)."""

    def half(self, spec: SumSpec, me: str, *, may_release) -> SiloHalf:
        raise AssertionError("no sum runs here")

    def min_counted(self, spec: SumSpec) -> int:
        return 1


def sum_spec(silos: tuple[str, ...]) -> SumSpec:
    return SumSpec("r1.a1", "contribution", silos, Schema((Field("delta", (2,), 1.0),)))


def test_a_lost_release_ledger_stops_every_study_when_any_studys_folder_shows_work(tmp_path):
    """The attack: releases.json deleted (or not restored) on a silo whose every trace of work is in its
    studies' folders. Counting only the top of the state directory, the agent would start afresh and could
    release the same data again over other silos; every study's agent refuses to start instead."""
    config = load_silo_config(kit(tmp_path, "readmission", "imaging"))
    root = tmp_path / "silo-0-state"
    with agents(config, "readmission"):
        pass
    (root / "studies" / "readmission" / "progress.json").write_text(json.dumps({"committed": 3}))
    (root / "releases.json").unlink()
    (root / "privacy-ledger.json").unlink()
    (root / "roster.json").unlink()
    with pytest.raises(LedgerMissing, match=r"studies/readmission/progress\.json in its state directory"):
        check_ledgers(root, root / "privacy-ledger.json")
    with pytest.raises(LedgerMissing, match=r"releases\.json is missing"):
        SiloAgent(config.for_study("imaging"))  # another study's agent: refused all the same


def test_the_default_study_goes_on_from_its_files_once_silo_toml_names_studies(tmp_path, caplog):
    """A silo that ran the aggregator's default study without tables, then names studies: [study.main]'s agent
    takes that study's progress, pending upload, stepped state and keys into its folder at its first start."""
    path = kit(tmp_path)
    with agents(load_silo_config(path), ""):
        pass
    root = tmp_path / "silo-0-state"
    (root / "progress.json").write_text(json.dumps({"committed": 4, "submitted": "r5.a1"}))
    (root / "pending.json").write_text("{}")
    (root / "pending.bin").write_bytes(b"pending")
    (root / "ckks").mkdir()
    (root / "ckks" / "enrollment.key").write_bytes(b"key")
    path.write_text(path.read_text() + "\n[study.main]\n\n[study.imaging]\n")
    config = load_silo_config(path)
    with agents(config, "imaging") as (imaging,):
        assert imaging.progress.read() == {}  # another study: nothing of the default study's
        assert (root / "progress.json").exists()
    caplog.set_level(logging.WARNING, logger="silo")
    note_single_run(root, ("imaging",))  # what `python -m silo run` says at its start without [study.main]
    assert "add a [study.main] table to go on with that study" in caplog.text
    with agents(config, "main") as (main_study,):
        assert main_study.progress.read() == {"committed": 4, "submitted": "r5.a1"}
        moved = root / "studies" / "main"
        assert (moved / "pending.bin").read_bytes() == b"pending"
        assert (moved / "ckks" / "enrollment.key").read_bytes() == b"key"
        assert not (root / "progress.json").exists()
        assert not (root / "ckks").exists()
        assert (root / "releases.json").exists()  # the silo's, across its studies: where they were
        assert (root / "roster.json").exists()


# ---------------------------------------------------------------- the study header on every call


class Recording(grpc.GenericRpcHandler):
    """A server that records each call's method and metadata, then answers `code`."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNIMPLEMENTED, details: str = "") -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.code, self.details = code, details
        self.called = threading.Condition()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        with self.called:
            self.calls.append((handler_call_details.method, dict(handler_call_details.invocation_metadata)))
            self.called.notify_all()
        if self.code == grpc.StatusCode.UNIMPLEMENTED:
            return None

        def answer(request: object, context: grpc.ServicerContext) -> object:
            context.abort(self.code, self.details)

        return grpc.unary_unary_rpc_method_handler(answer)

    def wait_for(self, calls: int) -> None:
        with self.called:
            assert self.called.wait_for(lambda: len(self.calls) >= calls, WAIT), self.calls


@contextmanager
def served(
    handler: grpc.GenericRpcHandler, credentials: grpc.ServerCredentials | None = None
) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


SERVICE = pb.DESCRIPTOR.services_by_name["ConsortiumService"]


def call_every_method(channel: grpc.Channel) -> list[str]:
    """Each RPC of the consortium service, once, as the silo's stub makes it; the methods called."""
    stub = consortium_pb2_grpc.ConsortiumServiceStub(channel)
    service = SERVICE
    called = []
    for method in service.methods:
        request = getattr(pb, method.input_type.name)()
        call = getattr(stub, method.name)
        argument = iter([request]) if method.client_streaming else request
        with pytest.raises(grpc.RpcError):
            list(call(argument, timeout=WAIT)) if method.server_streaming else call(argument, timeout=WAIT)
        called.append(f"/{service.full_name}/{method.name}")
    return called


def test_every_call_on_a_studys_channel_names_the_study_and_none_on_the_default_studys():
    recording = Recording()
    with served(recording) as address, grpc.insecure_channel(address) as channel:
        called = call_every_method(study_channel(channel, "imaging"))
        kinds = {(m.client_streaming, m.server_streaming) for m in SERVICE.methods}
        assert kinds == {(False, False), (False, True), (True, False)}  # every kind of call a silo makes
        assert [method for method, _ in recording.calls] == called
        assert all(metadata.get(STUDY_HEADER) == "imaging" for _, metadata in recording.calls)
        recording.calls.clear()
        call_every_method(study_channel(channel, ""))
        assert not any(STUDY_HEADER in metadata for _, metadata in recording.calls)


def test_the_header_replaces_any_study_a_call_named_itself():
    recording = Recording()
    with served(recording) as address, grpc.insecure_channel(address) as channel:
        stub = consortium_pb2_grpc.ConsortiumServiceStub(study_channel(channel, "imaging"))
        with pytest.raises(grpc.RpcError):
            stub.Heartbeat(pb.HeartbeatRequest(), metadata=[(STUDY_HEADER, "other")], timeout=WAIT)
        ((_, metadata),) = recording.calls
        assert metadata[STUDY_HEADER] == "imaging"


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def test_an_agent_waits_for_a_queued_study_saying_so_once_per_change_with_its_header_on_every_try(tmp_path):
    """An aggregator that does not take the study yet answers UNAVAILABLE (queued, paused) or NOT_FOUND (not
    created): the agent says so in plain words once per change, retries with its backoff, and logs no
    traceback."""
    path = kit(tmp_path, "imaging")
    pki = tmp_path / "pki"
    credentials = grpc.ssl_server_credentials(
        [((pki / "aggregator.key").read_bytes(), (pki / "aggregator.pem").read_bytes())],
        root_certificates=(pki / "ca" / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    aggregator = Recording(grpc.StatusCode.UNAVAILABLE, "study 'imaging' is queued (2nd in line)")
    said, logger, stop = Said(), logging.getLogger("silo"), threading.Event()
    logger.addHandler(said)
    with served(aggregator, credentials) as address:
        point_silos_at(address, [path])
        config = load_silo_config(path).for_study("imaging")
        agent = SiloAgent(config, stop=stop)
        runner = threading.Thread(target=agent.run, daemon=True)
        runner.start()
        try:
            aggregator.wait_for(2)
            aggregator.code, aggregator.details = (
                grpc.StatusCode.NOT_FOUND,
                "no study 'imaging' on this aggregator",
            )
            aggregator.wait_for(4)
        finally:
            stop.set()
            runner.join(WAIT)
            logger.removeHandler(said)
            agent.state_lock.release()
            agent.shared_hold.release()
    assert not runner.is_alive()
    assert all(metadata.get(STUDY_HEADER) == "imaging" for _, metadata in aggregator.calls)
    warnings = said.lines(logging.WARNING)
    queued = f"study 'imaging' is not open on the aggregator at {address} now (study 'imaging' is queued"
    missing = f"study 'imaging' is not on the aggregator at {address} (no study 'imaging' on this aggregator)"
    assert [w for w in warnings if w.startswith(queued)] == [warnings[0]]  # said once, though tried again
    assert sum(w.startswith(missing) for w in warnings) == 1
    assert not [w for w in warnings if "connection problem" in w or "Traceback" in w]
    assert not said.lines(logging.ERROR)


# ---------------------------------------------------------------- one process per study


def fake_agent(tmp_path: Path, behaviour: dict[str, str]):
    """A command line for each study: a tiny Python process doing what `behaviour` says of that study."""
    scripts = {
        "exit 0": "raise SystemExit(0)",
        "exit 3": "raise SystemExit(3)",
        "wait for SIGTERM": (
            "import os, signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
            "fifo = os.open(sys.argv[1], os.O_WRONLY)\n"  # the test reads it: the handler is set
            "os.write(fifo, b'ready'); os.close(fifo)\n"
            "while True: signal.pause()\n"
        ),
    }

    def command(study: str) -> list[str]:
        return [sys.executable, "-c", scripts[behaviour[study]], str(tmp_path / study)]

    for study, what in behaviour.items():
        if what == "wait for SIGTERM":
            os.mkfifo(tmp_path / study)
    return command


def ready(fifo: Path) -> None:
    """Until the fake agent on `fifo` says it set its handler (bounded)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        data = b""
        while not data:
            readable, _, _ = select.select([fd], [], [], WAIT)
            assert readable, f"{fifo.name}'s agent never said it was ready"
            data = os.read(fd, 16)
    finally:
        os.close(fd)


def test_the_supervisor_exits_0_once_every_study_finished_logging_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="silo")
    supervisor = Supervisor(["a", "b"], fake_agent(tmp_path, {"a": "exit 0", "b": "exit 0"}))
    assert supervisor.run() == 0
    ended = [r.getMessage() for r in caplog.records if "its agent ended" in r.getMessage()]
    assert sorted(ended) == [f"study '{s}': its agent ended (finished, or stopped on request)" for s in "ab"]


def test_one_studys_failure_takes_no_other_study_down_and_sets_the_exit_code(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="silo")
    supervisor = Supervisor(["a", "b"], fake_agent(tmp_path, {"a": "exit 3", "b": "wait for SIGTERM"}))
    supervisor.start()
    ready(tmp_path / "b")
    assert supervisor.processes["a"].wait(WAIT) == 3
    assert supervisor.processes["b"].poll() is None  # still running
    supervisor.stop()
    assert supervisor.wait() == 3
    assert (
        "study 'a': its agent exited with code 3 (its log lines above say why); the other studies go on"
        in [r.getMessage() for r in caplog.records]
    )


def test_sigterm_to_the_supervisor_reaches_every_study_which_stops_on_its_own(tmp_path):
    from silo.studies import forward_signals

    supervisor = Supervisor(
        ["a", "b"], fake_agent(tmp_path, {"a": "wait for SIGTERM", "b": "wait for SIGTERM"})
    )
    restore = forward_signals(supervisor)
    try:
        supervisor.start()
        ready(tmp_path / "a")
        ready(tmp_path / "b")
        os.kill(os.getpid(), signal.SIGTERM)  # as a service manager stops it
        assert supervisor.wait() == 0
    finally:
        restore()
    assert all(p.returncode == 0 for p in supervisor.processes.values())  # each left through its handler


def test_a_study_agent_does_not_outlive_a_supervisor_killed_outright(tmp_path):
    """SIGKILL leaves the supervisor no moment to pass anything on: the kernel's parent-death signal does."""
    script = (
        "import sys\n"
        "from silo.studies import Supervisor\n"
        "from tests.test_silo_studies import fake_agent\n"
        "from pathlib import Path\n"
        "Supervisor(['a'], fake_agent(Path(sys.argv[1]), {'a': 'wait for SIGTERM'})).run()\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=ENV)
    try:
        for _ in range(600):  # its fifo made, then its agent started (bounded)
            if (tmp_path / "a").exists():
                break
            time.sleep(0.1)
        ready(tmp_path / "a")
        agents = children_of(supervisor.pid)
        supervisor.kill()
        supervisor.wait(WAIT)
        for pid in agents:
            assert _gone(pid), f"study agent {pid} outlived its supervisor"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc; Linux, where the parent-death signal exists)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    """Whether `pid` has ended within `WAIT` seconds (an orphan is reaped by init, so it disappears)."""
    until = time.monotonic() + WAIT
    while time.monotonic() < until:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_python_m_silo_run_starts_an_agent_per_study_and_stops_them_on_sigterm(tmp_path):
    """The command itself: two studies' agents (real ones, dialling an aggregator that is not there), each
    line saying whose it is; SIGTERM stops both, each keeping its progress, and the command exits 0."""
    path = kit(tmp_path, "readmission", "imaging")
    with socket.socket() as closed:  # bound, not listening: every dial is refused at once
        closed.bind(("127.0.0.1", 0))
        point_silos_at(f"127.0.0.1:{closed.getsockname()[1]}", [path])
        process = subprocess.Popen(
            [sys.executable, "-m", "silo", "run", "--config", str(path)],
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        lines: list[str] = []
        waiting, dialled = {"readmission", "imaging"}, threading.Event()

        def read() -> None:
            for line in process.stderr:
                lines.append(line)
                waiting.difference_update({s for s in waiting if f"[{s}] WARNING connection problem" in line})
                if not waiting:
                    dialled.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert dialled.wait(WAIT), "".join(lines)
            process.send_signal(signal.SIGTERM)
            process.wait(WAIT)
            reader.join(WAIT)
        finally:
            process.kill()
            process.wait()
    text = "".join(lines)
    assert process.returncode == 0, text
    for study in ("readmission", "imaging"):
        assert f"[{study}] INFO stopped on request; progress is kept in" in text
        assert f"study '{study}': its agent ended (finished, or stopped on request)" in text
    assert "Traceback" not in text


def test_studies_agents_starting_together_on_a_new_state_directory_all_start(tmp_path):
    """The first start of a silo with studies: one study's agent checks the ledgers and pins the roster while
    another is starting. The check makes the empty book in the same hold of its lock, so the other agent finds
    a book beside the roster, not a roster without a book (it refused to start: "releases.json is missing,
    but this silo has worked before")."""
    privacy = tmp_path / "privacy-ledger.json"
    check_ledgers(tmp_path, privacy)  # the first agent
    (tmp_path / "roster.json").write_text("{}")  # which pins the roster next
    check_ledgers(tmp_path, privacy)  # the second agent, a moment later
    assert (tmp_path / LEDGER).exists()


def test_a_silo_without_studies_says_once_that_the_default_study_is_paused(caplog):
    """It said so at every retry, as a connection problem (found in the new-user walkthrough)."""
    from silo.connection import StudyWait

    waiting = StudyWait("", "aggregator.example:50051")
    paused = "study 'main' is paused: by operator"
    with caplog.at_level(logging.WARNING, logger="silo"):
        assert waiting.said(grpc.StatusCode.UNAVAILABLE, paused)
        assert waiting.said(grpc.StatusCode.UNAVAILABLE, paused)
        assert not waiting.said(grpc.StatusCode.UNAVAILABLE, "Socket closed")  # a connection problem
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "study 'main' is not open on the aggregator at aggregator.example:50051 now (" + paused + "); waiting"
    ]
