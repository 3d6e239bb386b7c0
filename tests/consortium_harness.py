"""Start and stop a real consortium (aggregator + silo processes on 127.0.0.1) for tests.

Every wait is bounded and every process started here is killed when the test ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from aggregator.catalog import STUDIES
from aggregator.config import ConsortiumSection, TimeoutSection, load_consortium_config
from aggregator.demo import demo_layer_settings, point_silos_at, wait_for_address, write_consortium
from aggregator.server import derive_audit_key
from aggregator.service import CertificateGate, ConsortiumServicer, Identity
from aggregator.store import DATABASE, AuditKey, Store
from fedlt.data.federation import DataConfig
from fedlt.keepalive import MIN_SECONDS
from fedlt.methods import TrainConfig
from fedlt.methods.state import GlobalState, unpack_state
from fedlt.plan import ModelSection, RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.pki.ca import init_ca, issue_server, issue_silo
from privacy.pki.identity import MemberTrust, RevocationList
from privacy.pki.roster import Roster, RosterFile, draft
from privacy.pki.signing import load_private_key
from silo.finish import DRILL

RECIPE = DataConfig(dataset="digits", imbalance=10.0, alpha=0.5, silos=3, min_silo_size=10, test_per_class=30)
PLAN = RoundPlan(
    model=ModelSection(name="cnn-small", image_shape=(1, 8, 8)),
    train=TrainConfig(local_epochs=1, batch_size=16, lr=0.05, momentum=0.9),
)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
# Test silos share the machine's cores; one thread each avoids OpenMP spinning on oversubscribed cores, and
# simulator runs they are compared with use the same count (results depend on it at float precision).
SILO_THREADS = 1
# Server steps that re-train a head (CReFF, CCVR) reduce in BLAS in an order that depends on the thread count;
# the aggregator runs with the simulator's count too (`Consortium.aggregator_threads`), so their states can be
# compared bit for bit.
# Stores tests build themselves; a live aggregator's store is keyed by its private key (`Consortium.store`).
AUDIT_KEY = AuditKey(b"fedlt tests' fixed audit key ...")


def write_kit(
    directory: Path, *, silos: int = 3, consortium_id: str = "test-consortium", plan: RoundPlan = PLAN
) -> list[Path]:
    """CA, roster and configs of a consortium of `silos` silos, for tests that start no process."""
    _, configs = write_consortium(
        directory,
        recipe=DataConfig(**{**RECIPE.__dict__, "silos": silos}),
        plan=plan,
        consortium=ConsortiumSection(id=consortium_id, min_silos=silos),
        timeouts=TimeoutSection(),
        record_floor=record_floor_for(plan),
    )
    return configs


def record_floor_for(plan: RoundPlan) -> int:
    """Tests of other things run methods releasing statistics that invert without DP: both sides accept a
    record floor of 2 for them (the default refuses them, docs/threat-model.md)."""
    fields, _ = plan.build_method().statistics_plan()
    return 2 if not plan.dp.enabled and any(f.per_class and f.inverts for f in fields) else 0


@dataclass
class Consortium:
    directory: Path
    silo_configs: list[Path]
    aggregator: subprocess.Popen | None = None
    silos: dict[int, subprocess.Popen] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)
    address: str = ""
    aggregator_threads: int = (
        SILO_THREADS  # benchmarks give it the simulator's count, which they compare with
    )

    @classmethod
    def create(
        cls,
        directory: Path,
        *,
        rounds: int,
        min_silos: int,
        round_timeout: float = 30.0,
        silos: int = 3,
        privacy: str = "secagg",
        plan: RoundPlan = PLAN,
        stage_timeout: float | None = None,
        recipe: DataConfig = RECIPE,
        tensorboard: bool = False,
    ) -> Consortium:
        """`stage_timeout`: `[timeouts] stage` (default: the aggregator's), how long a failed secure-sum stage
        holds up the retry. `recipe`: the embedded recipe the silos' shards and the aggregator's evaluation
        split come from. `tensorboard`: the aggregator writes event files, as by default (tests of other
        things spare each aggregator process loading tensorboard; tests/test_telemetry*.py test it)."""
        recipe = DataConfig(**{**recipe.__dict__, "silos": silos})
        stage = {} if stage_timeout is None else {"stage": stage_timeout}
        _, silo_configs = write_consortium(
            directory,
            recipe=recipe,
            plan=plan,
            consortium=ConsortiumSection(
                id="test-consortium", rounds=rounds, min_silos=min_silos, privacy=privacy
            ),
            timeouts=TimeoutSection(gather=3.0, round=round_timeout, keepalive=MIN_SECONDS, **stage),
            silo_threads=SILO_THREADS,
            layer_settings=demo_layer_settings(privacy),
            record_floor=record_floor_for(plan),
        )
        if not tensorboard:
            with (directory / "consortium.toml").open("a") as config:
                config.write("\n[monitoring]\ntensorboard = false\n")
        return cls(directory, silo_configs)

    def enroll(self, silo_id: str, directory: Path, **issue_options) -> None:
        """A new silo: a certificate from the consortium CA, and the operator's roster naming it (the
        aggregator re-reads the file; silos would adopt it only once a quorum signed it)."""
        issue_silo(self.directory / "pki" / "ca", directory, silo_id=silo_id, **issue_options)
        path = self.directory / "pki" / "roster.json"
        roster = Roster.read(path)
        members = [(m.id, m.certificate) for m in roster.members if m.role == "silo"]
        aggregator = (self.directory / "pki" / "aggregator.pem").read_bytes()
        grown = draft(
            roster.consortium,
            aggregator=aggregator,
            silos=[*members, (silo_id, (directory / f"{silo_id}.pem").read_bytes())],
            previous=roster,
        )
        path.write_bytes(grown.to_json())

    @property
    def data_dir(self) -> Path:
        return self.directory / "aggregator-data"

    def start_aggregator(self) -> None:
        """Start (or restart) the aggregator; a restart listens on the port of the first start, as a
        deployment with a fixed port would, so running silos find it again."""
        if self.address:
            config = self.directory / "consortium.toml"
            config.write_text(
                config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "{self.address}"')
            )
        self.aggregator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aggregator",
                "serve",
                "--config",
                str(self.directory / "consortium.toml"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**ENV, "OMP_NUM_THREADS": str(self.aggregator_threads)},
        )
        self._reader = threading.Thread(target=self._pump, args=(self.aggregator,), daemon=True)
        self._reader.start()
        address = wait_for_address(self.data_dir, self.aggregator, timeout=60)
        if not self.address:
            point_silos_at(address, self.silo_configs)
            self.address = address

    def _pump(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.output.append(line.rstrip("\n"))

    def start_silo(self, k: int, drill: str = "") -> None:
        """`drill`: the silo freezes itself after sending that secure sum's message (see silo.finish)."""
        log = (self.directory / f"silo-{k}.log").open("a")
        self.silos[k] = subprocess.Popen(
            [sys.executable, "-m", "silo", "run", "--config", str(self.silo_configs[k])],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**ENV, DRILL: drill} if drill else ENV,
        )

    def start(self, drills: dict[int, str] | None = None) -> None:
        self.start_aggregator()
        for k in range(len(self.silo_configs)):
            self.start_silo(k, (drills or {}).get(k, ""))

    def wait_for_silo_log(self, k: int, text: str, timeout: float = 180) -> None:
        log = self.directory / f"silo-{k}.log"
        until = time.monotonic() + timeout
        while text not in (log.read_text() if log.exists() else ""):
            if time.monotonic() > until:
                raise AssertionError(f"silo-{k} did not log {text!r} within {timeout} s")
            time.sleep(0.05)

    def wait_for_output(self, predicate: Callable[[str], bool], timeout: float) -> str:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            for line in list(self.output):
                if predicate(line):
                    return line
            time.sleep(0.1)
        raise AssertionError(
            f"no matching aggregator output within {timeout} s; got:\n" + "\n".join(self.output)
        )

    def freeze_after_registering(self, k: int, timeout: float = 60) -> None:
        """SIGSTOP silo k once it has registered: it stays connected, is invited, and never answers."""
        self.wait_for_silo_log(k, "registered as", timeout)
        self.silos[k].send_signal(signal.SIGSTOP)

    def wait_for_attempt(self, round_number: int, timeout: float = 60) -> None:
        until = time.monotonic() + timeout
        while True:
            store = self.store()
            try:
                if store._db.execute("SELECT 1 FROM attempts WHERE round = ?", (round_number,)).fetchone():
                    return
            finally:
                store.close()
            if time.monotonic() > until:
                raise AssertionError(f"round {round_number} did not start within {timeout} s")
            time.sleep(0.05)

    def committed(self) -> dict[int, list[str]]:
        """Every committed round (0: the initial state) and the silos its sum counted."""
        store = self.store()
        try:
            rows = store._db.execute("SELECT round, contributors FROM states ORDER BY round").fetchall()
        finally:
            store.close()
        return {r: json.loads(c) for r, c in rows}

    def wait_for_round(self, round_number: int, timeout: float = 180) -> None:
        """Until round `round_number` (or a later one) is committed."""
        until = time.monotonic() + timeout
        while max(self.committed(), default=0) < round_number:
            if time.monotonic() > until:
                raise AssertionError(f"round {round_number} was not committed within {timeout} s")
            time.sleep(0.2)

    def wait_aggregator(self, timeout: float) -> int:
        assert self.aggregator is not None
        try:
            code = self.aggregator.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("aggregator did not finish; output:\n" + "\n".join(self.output)) from None
        self._reader.join(timeout)  # its last lines read: the reader ends at the pipe's end
        return code

    def kill(self, process: subprocess.Popen) -> None:
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for p in [self.aggregator, *self.silos.values()]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)

    def final_state(self) -> GlobalState:
        store = self.store()
        try:
            latest = store.latest_state()
            return unpack_state(latest.data, latest.round)
        finally:
            store.close()

    def store(self, study: str = "") -> Store:
        """The store of a study (the default one unless named), opened with the audit key the aggregator
        derives from its private key."""
        config = load_consortium_config(self.directory / "consortium.toml")
        key = derive_audit_key(load_private_key(config.path(config.server.key)))
        data_dir = self.data_dir / STUDIES / study if study else self.data_dir
        return Store(data_dir / DATABASE, audit_key=key)


class PayloadEngine:
    """Stands in for the round engine behind the real servicer: hands out and accepts one payload size."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.config = SimpleNamespace(consortium=SimpleNamespace(id="payload", privacy="plaintext"))

    def state_for(self, silo_id: str, round_id: str) -> bytes:
        return self.payload

    def upload_bytes(self, silo_id: str, round_id: str, purpose: str, kind: type) -> int:
        return len(self.payload)

    def upload(self, silo_id: str, round_id: str, purpose: str, message: object, digest: str) -> str:
        return digest


def no_members(directory: Path, identity: Identity) -> dict:
    """`members`, `roster` and `relay` for a servicer whose tests never register a silo: a roster of the
    aggregator, and no key service."""
    path = directory / "roster.json"
    roster = draft("payload", aggregator=(directory / "aggregator.pem").read_bytes(), silos=[])
    path.write_bytes(roster.to_json())
    ca = (directory / "ca" / "ca.pem").read_bytes()
    return {
        "members": MemberTrust(ca, roster, identity.revocations),
        "roster": RosterFile(path),
        "relay": None,
    }


@contextmanager
def servicer_channel(
    directory: Path,
    engine: object,
    store: object = None,
    *,
    gated: bool = False,
    submit_seconds: float = 120.0,
) -> Iterator[grpc.Channel]:
    """The real ConsortiumServicer before `engine` (behind the certificate gate if `gated`), over mutual TLS
    on 127.0.0.1, and a channel connected to it as silo-0."""
    init_ca(directory / "ca", name="servicer CA")
    issue_server(directory / "ca", directory, hosts=["127.0.0.1"])
    issue_silo(directory / "ca", directory, silo_id="silo-0")
    ca = (directory / "ca" / "ca.pem").read_bytes()
    identity = Identity(RevocationList.load(directory / "ca" / "ca.pem", directory / "ca" / "crl.pem"))
    interceptors = [CertificateGate(identity)] if gated else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    servicer = ConsortiumServicer(
        engine, store, identity, b"", **no_members(directory, identity), submit_seconds=submit_seconds
    )
    consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server(servicer, server)
    key_pair = ((directory / "aggregator.key").read_bytes(), (directory / "aggregator.pem").read_bytes())
    port = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([key_pair], root_certificates=ca, require_client_auth=True)
    )
    server.start()
    client = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(directory / "silo-0.key").read_bytes(),
        certificate_chain=(directory / "silo-0.pem").read_bytes(),
    )
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", client) as channel:
            yield channel
    finally:
        server.stop(0)


@contextmanager
def payload_server(directory: Path, payload: bytes) -> Iterator[consortium_pb2_grpc.ConsortiumServiceStub]:
    """The real ConsortiumServicer over mutual TLS on 127.0.0.1, and a stub connected as silo-0."""
    with servicer_channel(directory, PayloadEngine(payload)) as channel:
        yield consortium_pb2_grpc.ConsortiumServiceStub(channel)


# --- playing a silo (or an intruder) by hand over real mutual TLS ---------------------------------------


def channel(consortium: Consortium, name: str | None, *, ca_dir=None) -> grpc.Channel:
    pki = consortium.directory / "pki"
    ca = (pki / "ca" / "ca.pem").read_bytes()
    if name is None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
    else:
        where = ca_dir or pki
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(where / f"{name}.key").read_bytes(),
            certificate_chain=(where / f"{name}.pem").read_bytes(),
        )
    return grpc.secure_channel(consortium.address, creds)


def register(ch: grpc.Channel) -> pb.RegisterResponse:
    request = pb.RegisterRequest(agent_version="fedlt-tests/0")
    return consortium_pb2_grpc.ConsortiumServiceStub(ch).Register(request, timeout=10)


def read_all(stream, into: queue.Queue) -> None:
    """Collect directives until the stream ends (the channel closing at the end of a test ends it)."""
    try:
        for directive in stream:
            into.put(directive)
    except grpc.RpcError:
        return


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()
