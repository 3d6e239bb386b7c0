"""One study's run inside the aggregator: its store, round driver, service, recorder and metrics.

The aggregator (`aggregator.server`) owns what every study shares: the TLS identity, the signing key, the
roster, the gRPC server, the status page. A `StudyRun` is what one study adds: its own store (and audit
chain) in its own data directory, its method and privacy layer, the layer's key-service relay where it asks
for one, the round driver on a thread of its own, the `ConsortiumServicer` the silos' calls for the study are
routed to (`aggregator.studies`), and where its rounds are recorded (run/, TensorBoard, MLflow).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aggregator.config import ConsortiumConfig
from aggregator.inbox import RoundInbox
from aggregator.key_service import KeyServiceRelay
from aggregator.rounds import RoundDriver
from aggregator.service import ConsortiumServicer, Identity
from aggregator.status_page import audit_tally
from aggregator.store import DATABASE, AuditKey, Store, StoreError
from fedlt.aggregation import make_layer, record
from fedlt.aggregation.halves import PartyKeys
from fedlt.config import as_table
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.dp import DPSettings
from fedlt.recorder import RunRecorder
from fedlt.seeding import derive_seed
from fedlt.telemetry import TENSORBOARD, MlflowTarget, Telemetry, open_telemetry, tag_part
from fedlt.telemetry.prometheus import ConsortiumFacts
from privacy.peers import ConsortiumPeers
from privacy.pki.identity import MemberTrust
from privacy.pki.roster import RosterFile

log = logging.getLogger("aggregator")


@dataclass(frozen=True)
class Shared:
    """What every study's run is given by the aggregator that hosts it."""

    identity: Identity
    members: MemberTrust
    roster: RosterFile
    certificate_pem: bytes
    audit_key: AuditKey
    sign: Callable[[bytes], bytes]
    echo: Callable[[str], None]


class StudyRun:
    """`name`: how the aggregator's messages name the study ("" for the default study, which they name as
    the consortium, as a single run's did)."""

    def __init__(self, study: str, config: ConsortiumConfig, shared: Shared, *, name: str = "") -> None:
        self.study, self.config, self.name = study, config, name
        self.data_dir = config.path(config.server.data_dir)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.store = Store(self.data_dir / DATABASE, audit_key=shared.audit_key, retention=config.retention)
        try:
            self.relay, self.rounds = self._driver(shared)
        except BaseException:
            self.store.close()
            raise
        self.servicer = ConsortiumServicer(
            self.rounds.inbox,
            self.store,
            shared.identity,
            shared.certificate_pem,
            members=shared.members,
            roster=shared.roster,
            relay=self.relay,
            submit_seconds=config.timeouts.round,
        )
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _driver(self, shared: Shared) -> tuple[KeyServiceRelay | None, RoundDriver]:
        config = self.config
        layer = make_layer(config.consortium.privacy, config.layer_settings())
        # the key service's relay, only where the layer asks for one (its record's `key_service`)
        relay = KeyServiceRelay.for_layer(record(config.consortium.privacy), config.layer_settings())
        facts = RoundFacts(self.store, dp=config.plan.dp.enabled)
        rounds = RoundDriver(
            config=config,
            store=self.store,
            method=config.plan.build_method(),
            layer=layer,
            side=layer.aggregator_side(PartyKeys(peers=ConsortiumPeers(shared.members), secret=relay)),
            sign=shared.sign,
            recorder=open_recorder(config, self.data_dir, self.store, facts=facts, study=self.name),
            echo=lambda text: shared.echo(self.say(text)),  # two studies' round lines, told apart
            roster=lambda: shared.roster.current().silo_ids,
        )
        facts.rounds = rounds
        return relay, rounds

    def start(self, on_end: Callable[[StudyRun], None]) -> None:
        """Drive the study's rounds on a thread of its own; `on_end` is called from it when they stop."""

        def drive() -> None:
            self.rounds.run(self.stop)
            on_end(self)

        self._thread = threading.Thread(target=drive, name=f"rounds-{self.study}", daemon=True)
        self._thread.start()

    def halt(self, reason: str) -> None:
        """Stop driving rounds: the attempt in flight is aborted with `reason`, and silos are let go."""
        self.rounds.stop_reason = reason
        self.stop.set()

    def join(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def committed(self) -> int:
        return self.rounds.table.held.round

    @property
    def finished(self) -> bool:
        return self.rounds.failure is None and not self.rounds.committer.round_due()

    def progress(self) -> dict:
        """What the catalog keeps of the study once its run stops (`aggregator.catalog.StudyInfo`)."""
        return {
            "method": self.config.plan.method.name,
            "privacy": self.config.consortium.privacy,
            "committed_rounds": self.committed,
            "total_rounds": self.rounds.table.total_rounds,
            "state_digest": self.rounds.table.held.digest,
            "dp_enabled": self.config.plan.dp.enabled,
        }

    def say(self, text: str) -> str:
        """`text` as the aggregator prints it of this study (the default study's lines read as a run's)."""
        if not self.name:
            return text
        body = text.lstrip("\n")
        return f"{text[: len(text) - len(body)]}study {self.name!r}: {body}"

    def close(self, echo: Callable[[str], None]) -> None:
        """Let the silos go, say how the run ended and release the store (the run's thread has ended)."""
        self.rounds.table.sessions.end_all()
        recorder = self.rounds.recorder
        if recorder is not None and recorder.rounds and self.finished:  # a paused or stopped run's is not
            echo(self.say(f"\nfinal test accuracy after round {self.committed}:\n{recorder.finish()}"))
        if recorder is not None:
            recorder.close()  # TensorBoard's files flushed, MLflow told what is left
        if self.rounds.failure is not None:
            echo(self.say(f"stopped after round {self.committed} on an internal error (see the log above)"))
        elif self.finished:
            echo(self.say("all rounds committed"))
        else:
            echo(self.say(f"stopped after round {self.committed}"))
        self.store.close()

    def about(self) -> dict:
        """The facts of the study the status page and status RPC show beside its round table."""
        config = self.config
        return {
            "consortium_id": config.consortium.id,
            "study": self.study,
            "method": config.plan.method.name,
            "privacy": config.consortium.privacy,
            "total_rounds": self.rounds.table.total_rounds,
            "dp_enabled": config.plan.dp.enabled,
        }

    def facts(self) -> ConsortiumFacts:
        return study_facts(self.config, self.rounds.inbox, self.store, study=self.study)

    def describe_layer(self) -> str:
        return self.rounds.layer.describe()


def dp_line(dp: DPSettings) -> str:
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


class RoundFacts:
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


def study_telemetry(
    config: ConsortiumConfig,
    data_dir: Path,
    history: list[dict],
    classes: tuple[str, ...],
    facts: RoundFacts | None,
    *,
    study: str = "",
) -> Telemetry:
    """TensorBoard's event files in data_dir/tensorboard and the MLflow run, as [monitoring] says; the MLflow
    run is this data directory's (a new data directory, a new run), named after the study if it has a name."""
    monitoring = config.monitoring
    mlflow = None
    if monitoring.mlflow_uri:
        mlflow = MlflowTarget(
            monitoring.mlflow_uri,
            monitoring.mlflow_experiment,
            monitoring.mlflow_run or study or config.consortium.id,
            key=f"{data_dir.resolve()}|{config.consortium.id}",
        )
    folder = data_dir / TENSORBOARD if monitoring.tensorboard else None
    return open_telemetry(folder, history=history, classes=classes, mlflow=mlflow, extra=facts)


def open_recorder(
    config: ConsortiumConfig,
    data_dir: Path,
    store: Store,
    *,
    facts: RoundFacts | None = None,
    study: str = "",
) -> RunRecorder | None:
    """Where rounds are evaluated: the silos' summed held-out counts, or the operator's own evaluation set;
    the history is restored from the store. `facts`: each round's facts besides its accuracy, for its
    telemetry."""
    evaluation, method = config.evaluation, config.plan.method.name
    header = {"consortium": as_table(config.consortium), "plan": as_table(config.plan)}
    history = store.metrics_history()
    named = f"consortium {config.consortium.id!r}" + (f", study {study!r}" if study else "")
    if config.silos_evaluate and not evaluation.dataset:
        # with held-out evaluation the shot groups' counts are summed in round 1, kept with round 0's metrics
        kept = next((entry["train_counts"] for entry in history if "train_counts" in entry), None)
        counts = evaluation.class_counts or kept
        classes = tuple(config.plan.model.classes)
        return RunRecorder(
            data_dir / "run",
            title=f"{method} {named}, evaluated on the silos' held-out data",
            test=None,
            classes=classes,
            train_counts=counts,
            thresholds=config.metrics,
            header=header,
            rounds=history,
            telemetry=study_telemetry(config, data_dir, history, classes, facts, study=study),
        )
    if not evaluation.dataset:
        return None
    seed = derive_seed(config.consortium.seed, "test-split")
    _, test = split_balanced_test(
        load_embedded(evaluation.dataset), per_class=evaluation.test_per_class, seed=seed
    )
    return RunRecorder(
        data_dir / "run",
        title=f"{method} {named}, evaluated on {evaluation.dataset}",
        test=test,
        train_counts=evaluation.class_counts or None,
        thresholds=config.metrics,
        header=header,
        rounds=history,
        telemetry=study_telemetry(config, data_dir, history, tuple(test.classes), facts, study=study),
    )


def study_facts(config: ConsortiumConfig, inbox: RoundInbox, store: Store, *, study: str) -> ConsortiumFacts:
    """What `/metrics` shows of a study, gathered at each scrape: the round table's view, the recorded
    metrics, and what the audit log says (its chain verified over every record, as the status page does)."""
    status, records = inbox.status(), store.audit_log()
    tally = audit_tally(records)
    try:
        store.verify_audit()
        verified = True
    except StoreError:
        verified = False
    return ConsortiumFacts(
        consortium=config.consortium.id,
        study=study,
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
    )
