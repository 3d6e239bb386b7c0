"""Metrics where operators look, each read back by its own library: TensorBoard's event files by
tensorboard's `EventAccumulator`, the aggregator's and a silo's Prometheus endpoints scraped over HTTP and
parsed by `prometheus_client`'s parser, and MLflow (a server that is down; a real one in
test_telemetry_mlflow.py). Servers bind 127.0.0.1, port 0."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from aggregator.catalog import STATES, StudyInfo
from aggregator.config import ConsortiumConfig, ConsortiumSection, load_consortium_config
from aggregator.status_page import StatusPage, study_states
from aggregator.store import AuditKey, Store
from aggregator.study_run import RoundFacts, study_facts
from fedlt.config import read_toml, render_toml
from fedlt.errors import ConfigError
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import CHECKPOINT, run_simulation
from fedlt.telemetry import TENSORBOARD, Telemetry, class_tags, open_telemetry, scalars
from fedlt.telemetry.prometheus import ConsortiumCollector, MetricsServer, exposition
from fedlt.telemetry.to_mlflow import MlflowSink, MlflowTarget
from privacy.pki.ca import init_ca
from privacy.pki.identity import RevocationList
from silo.agent import SiloAgent
from silo.config import load_silo_config
from silo.transport import SiloTransport
from tests.consortium_harness import write_kit
from tests.test_silo_refusals import RecordingStub, signed_spec

FAST = {"dataset": "digits", "silos": 3, "imbalance": 10.0, "alpha": 0.5}
AUDIT_KEY = AuditKey(b"fedlt tests' fixed audit key ...")
LIMIT = 60.0  # seconds any wait here may take on a busy machine


def _quiet(_line: str) -> None:
    pass


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in `folder`'s event files, as TensorBoard's own reader loads them."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(metrics: dict) -> dict[str, list[tuple[int, float]]]:
    """The series metrics.json's rounds give, under their tags."""
    classes = metrics["dataset"]["classes"]
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in metrics["rounds"]:
        for tag, value in scalars(entry, classes).items():
            series.setdefault(tag, []).append((entry["round"], value))
    return series


# --- TensorBoard ------------------------------------------------------------------------------------------


def test_the_simulator_writes_every_round_as_tensorboard_reads_it(tmp_path):
    run_simulation(load_sim_config(None, {**FAST, "rounds": 2}), tmp_path, echo=_quiet)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    found = _scalars(tmp_path / TENSORBOARD)
    for tag in ("accuracy/overall", "accuracy/medium", "round/seconds", "accuracy/class/0"):
        assert [step for step, _ in found[tag]] == [1, 2], tag
    assert found.keys() == _expected(metrics).keys()
    for tag, series in _expected(metrics).items():
        assert found[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in series], tag
    final = metrics["rounds"][-1]
    assert found["accuracy/overall"][-1][1] == pytest.approx(final["accuracy"], rel=1e-6)
    # the digits recipe at IF 10 has no many-shot class: no series rather than zeros
    assert final["many"] is None
    assert "accuracy/many" not in found


def test_a_run_resumed_before_its_last_written_round_shows_each_round_once(tmp_path):
    """A run killed after writing round 2's events but before keeping round 2's checkpoint (here: its round 1
    checkpoint put back), resumed with more rounds: round 2 is written again and TensorBoard shows each round
    once, with the values metrics.json ends with."""
    kept = tmp_path / "checkpoint-after-round-1.pt"

    def keep_round_one(r: int, _total: int, _entry: dict) -> None:
        if r == 1:
            shutil.copy(tmp_path / "run" / CHECKPOINT, kept)

    out = tmp_path / "run"
    run_simulation(load_sim_config(None, {**FAST, "rounds": 2}), out, echo=_quiet, on_round=keep_round_one)
    shutil.copy(kept, out / CHECKPOINT)
    run_simulation(load_sim_config(None, {**FAST, "rounds": 3}), out, echo=_quiet)
    assert len(list((out / TENSORBOARD).glob("events.out.tfevents.*"))) == 2
    found = _scalars(out / TENSORBOARD)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["round"] for r in metrics["rounds"]] == [1, 2, 3]
    for tag, series in _expected(metrics).items():
        assert [step for step, _ in found[tag]] == [1, 2, 3], tag
        assert found[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in series], tag


def test_tensorboard_shows_each_round_of_the_history_once_whichever_side_a_restart_lost(tmp_path):
    """A folder without event files gets the whole history; a start whose history runs past the files (the
    aggregator keeps a round before writing it) writes the rounds they lack; one whose files run past its
    history (the simulator writes a round before keeping it) has TensorBoard drop what comes after."""

    def run(history: list[float], new: float) -> None:
        entries = [{"round": r, "accuracy": a} for r, a in enumerate(history)]
        telemetry = open_telemetry(tmp_path, history=entries, classes=())
        telemetry.record({"round": len(history), "accuracy": new}, ())
        telemetry.close()

    def shown() -> list[tuple[int, float]]:
        return [(s, round(v, 3)) for s, v in _scalars(tmp_path)["accuracy/overall"]]

    run([0.1, 0.2], 0.3)
    assert shown() == [(0, 0.1), (1, 0.2), (2, 0.3)]
    run([0.1, 0.2, 0.3, 0.4], 0.5)  # round 3 kept, never written
    assert shown() == [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5)]
    run([0.1, 0.2], 0.33)  # rounds 2 to 4 written, never kept: round 2 again, with what it gives now
    assert shown() == [(0, 0.1), (1, 0.2), (2, 0.33)]


def test_a_round_written_again_from_the_history_keeps_its_facts_besides_the_accuracy(tmp_path):
    """The last round the files hold is written again at a start (a killed writer may have left part of it):
    with the aggregator's facts of that round (here, the silos its sum counted), not the accuracy alone."""

    def counted(round_number: int) -> dict[str, float]:
        return {"silos/counted": 3.0}

    first = open_telemetry(tmp_path, history=[], classes=(), extra=counted)
    first.record({"round": 1, "accuracy": 0.5}, ())
    first.close()
    open_telemetry(tmp_path, history=[{"round": 1, "accuracy": 0.5}], classes=(), extra=counted).close()
    assert _scalars(tmp_path)["silos/counted"] == [(1, 3.0)]


def test_class_tags_are_names_mlflow_and_tensorboard_take_and_stay_apart():
    tags = class_tags(["cat", "a/b", "a_b", "..", "Pleural effusion", "é"])
    assert tags == [
        "accuracy/class/cat",
        "accuracy/class/a_b_1",
        "accuracy/class/a_b_2",
        "accuracy/class/__",
        "accuracy/class/Pleural effusion",
        "accuracy/class/é",
    ]


def test_a_sink_that_fails_is_logged_and_the_round_goes_on(caplog):
    class Broken:
        def write(self, step: int, values: dict) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            raise OSError("disk full")

    written: list[int] = []

    class Kept:
        def write(self, step: int, values: dict) -> None:
            written.append(step)

        def close(self) -> None:
            pass

    telemetry = Telemetry([Broken(), Kept()])
    with caplog.at_level(logging.ERROR, logger="fedlt.telemetry"):
        telemetry.record({"round": 1, "accuracy": 0.5}, ())
        telemetry.close()
    assert written == [1]
    assert "round 1: writing to" in caplog.text
    assert "failed; the run goes on" in caplog.text


# --- MLflow, its server down ------------------------------------------------------------------------------


def test_an_mlflow_server_that_is_down_holds_up_no_round(tmp_path, monkeypatch, caplog):
    """Rounds are handed over at once; the failure is logged once; what was not sent is named at close."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as probe:  # a port nothing listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = MlflowTarget(f"http://127.0.0.1:{port}", "fedlt", "down", key=str(tmp_path))
    sink = MlflowSink(target, history=[], close_seconds=LIMIT)
    telemetry = Telemetry([sink])
    with caplog.at_level(logging.INFO, logger="fedlt.telemetry"):
        started = time.monotonic()
        for r in (1, 2, 3):
            telemetry.record({"round": r, "accuracy": 0.5}, ())
        handed_over = time.monotonic() - started
        telemetry.close()
    assert handed_over < 5.0  # three rounds queued, not sent: nothing waited on the server
    assert caplog.text.count("rounds wait and are sent once it answers") == 1
    assert "did not take rounds 1, 2, 3 before the run closed" in caplog.text


# --- the aggregator's /metrics ----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    """Two committed rounds, each inviting alpha and beta and counting alpha; a refused and an aborted
    attempt; the metrics of both rounds."""
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    s.save_initial_state("d0", b"w")
    for r in (1, 2):
        _, round_id = s.begin_attempt(r, ["alpha", "beta"], f"n{r}")
        s.record_contribution(round_id, "alpha", "ab" * 32)
        s.commit_round(round_number=r, round_id=round_id, digest=f"d{r}", data=b"w", contributors=["alpha"])
        per_class = [0.5 + r / 10, None, 0.25]
        s.save_metrics(
            r,
            {
                "round": r,
                "accuracy": 0.5 + r / 10,
                "few": r / 10,
                "many": 0.9,
                "medium": None,
                "per_class": per_class,
                "seconds": 4.0 * r,
                "contributors": ["alpha"],
            },
        )
    _, refused = s.begin_attempt(3, ["alpha", "beta"], "n3")
    s.record_refusal(refused, "beta", "policy", "not this method")
    s.abort_attempt(refused, "refused by beta (policy)")
    yield s
    s.close()


@pytest.fixture
def imaging(tmp_path):
    """A second study's store: one committed round counting alpha and gamma, 50 seconds, not evaluated."""
    s = Store(tmp_path / "imaging.sqlite", audit_key=AUDIT_KEY)
    s.save_initial_state("i0", b"w")
    _, round_id = s.begin_attempt(1, ["alpha", "gamma"], "i1")
    for silo in ("alpha", "gamma"):
        s.record_contribution(round_id, silo, "cd" * 32)
    s.commit_round(round_number=1, round_id=round_id, digest="i1", data=b"w", contributors=["alpha", "gamma"])
    s.save_metrics(1, {"round": 1, "seconds": 50.0, "contributors": ["alpha", "gamma"]})
    yield s
    s.close()


SILOS = [
    {
        "silo_id": "alpha",
        "connected": True,
        "last_seen_unix_ms": 1_700_000_000_000,
        "activity": "idle",
        "last_contributed_round": 2,
        "privacy_remaining": 6.5,
    },
    {
        "silo_id": "beta",
        "connected": False,
        "last_seen_unix_ms": 0,
        "activity": "offline",
        "last_contributed_round": 0,
    },
]
IMAGING_SILOS = [
    {
        **SILOS[0],
        "last_contributed_round": 1,
        "privacy_remaining": 2.25,
    },  # one ledger, reported in each study
    {
        **SILOS[0],
        "silo_id": "gamma",
        "connected": False,
        "last_contributed_round": 1,
        "privacy_remaining": None,
    },
]


def _config(*, dp: bool, method: str = "fedavg", privacy: str = "secagg") -> ConsortiumConfig:
    config = ConsortiumConfig(consortium=ConsortiumSection(id="st-test", rounds=5, privacy=privacy))
    plan = replace(config.plan, dp=replace(config.plan.dp, enabled=dp))
    return replace(config, plan=replace(plan, method=replace(plan.method, name=method)))


def _inbox(
    held_bytes: int = 1234, *, silos: list[dict] = SILOS, committed: int = 2, total: int = 5
) -> SimpleNamespace:
    """What `study_facts` reads of a study's round inbox: its status, the rounds asked for, the held state."""
    status = {
        "committed_rounds": committed,
        "stage": "gathering",
        "round_id": "",
        "deadline_ms": 0,
        "participants": [],
        "submitted": [],
        "state_digest": "d2",
        "silos": silos,
    }
    table = SimpleNamespace(held=SimpleNamespace(blob=b"x" * held_bytes))
    return SimpleNamespace(status=lambda: status, total_rounds=total, table=table)


def _page(tmp_path: Path, *, metrics=None) -> StatusPage:
    init_ca(tmp_path / "ca", name="test CA")
    revocations = RevocationList.load(tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "crl.pem")
    return StatusPage(
        "127.0.0.1:0", dict, revocations, token_file=tmp_path / "status-page.token", metrics=metrics
    ).start()


def _scrape(url_host: str, port: int, headers: dict[str, str]) -> tuple[int, str, str]:
    connection = http.client.HTTPConnection(url_host, port, timeout=LIMIT)
    connection.request("GET", "/metrics", headers=headers)
    response = connection.getresponse()
    return response.status, response.getheader("Content-Type") or "", response.read().decode()


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    (found,) = [
        s.value
        for s in families[name].samples
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return found


def _aggregator(store: Store, imaging: Store) -> bytes:
    """The exposition of an aggregator running the default study and `imaging` (fedprox over ckks, no
    evaluation), with a third study queued and one done long ago whose run is closed (no facts)."""
    studies = [
        study_facts(_config(dp=True), _inbox(), store, study="main"),
        study_facts(
            _config(dp=True, method="fedprox", privacy="ckks"),
            _inbox(99, silos=IMAGING_SILOS, committed=1, total=2),
            imaging,
            study="imaging",
        ),
    ]
    catalog = [
        StudyInfo(study, state, "", 0, 0, 0, study == "main")
        for study, state in (("main", "running"), ("imaging", "running"), ("later", "queued"), ("y", "done"))
    ]
    return exposition(ConsortiumCollector(studies, states=study_states(catalog), certificate_warnings=1))


@pytest.fixture
def scraped_page(tmp_path, store, imaging):
    page = _page(tmp_path, metrics=lambda: _aggregator(store, imaging))
    yield page
    page.stop()


def _scraped(page: StatusPage) -> dict:
    host, port = page.server.server_address[:2]
    token = page.token_file.read_text().strip()
    status, kind, text = _scrape(host, port, {"Authorization": f"Bearer {token}"})
    assert status == 200
    assert kind.startswith("text/plain; version=0.0.4")
    return _families(text)


def test_prometheus_reads_each_studys_metrics_under_its_label_with_the_bearer_token(scraped_page):
    f = _scraped(scraped_page)
    main = {"study": "main"}
    assert f["fedlt_rounds_committed"].type == "counter"
    assert _value(f, "fedlt_rounds_committed", "fedlt_rounds_committed_total", **main) == 2
    assert _value(f, "fedlt_rounds_planned", **main) == 5
    assert f["fedlt_round_duration_seconds"].type == "histogram"
    assert _value(f, "fedlt_round_duration_seconds", "fedlt_round_duration_seconds_count", **main) == 2
    assert _value(f, "fedlt_round_duration_seconds", "fedlt_round_duration_seconds_sum", **main) == 12.0
    bucket = "fedlt_round_duration_seconds_bucket"
    assert _value(f, "fedlt_round_duration_seconds", bucket, le="5.0", **main) == 1
    assert f["fedlt_test_accuracy"].type == "gauge"
    assert _value(f, "fedlt_test_accuracy", group="overall", **main) == pytest.approx(0.7)
    assert _value(f, "fedlt_test_accuracy", group="few", **main) == pytest.approx(0.2)
    assert {s.labels["group"] for s in f["fedlt_test_accuracy"].samples} == {"overall", "many", "few"}
    assert _value(f, "fedlt_test_accuracy_round", **main) == 2
    classes = ConsortiumConfig().plan.model.classes
    per_class = {s.labels["class"]: s.value for s in f["fedlt_test_class_accuracy"].samples}
    assert per_class == {classes[0]: pytest.approx(0.7), classes[2]: 0.25}  # class 1: no records, no sample
    assert _value(f, "fedlt_silos_connected", **main) == 1
    assert _value(f, "fedlt_silos_registered", **main) == 2
    assert _value(f, "fedlt_silo_connected", silo="beta", **main) == 0
    assert _value(f, "fedlt_silo_last_seen_timestamp_seconds", silo="alpha", **main) == 1_700_000_000
    assert _value(f, "fedlt_epsilon_remaining", silo="alpha", **main) == 6.5
    assert _value(f, "fedlt_dropouts", "fedlt_dropouts_total", **main) == 2
    assert _value(f, "fedlt_refusals", "fedlt_refusals_total", code="policy", **main) == 1
    assert _value(f, "fedlt_attempts", "fedlt_attempts_total", outcome="committed", **main) == 2
    assert _value(f, "fedlt_attempts", "fedlt_attempts_total", outcome="aborted", **main) == 1
    assert _value(f, "fedlt_contributions", "fedlt_contributions_total", **main) == 2
    assert _value(f, "fedlt_state_bytes", **main) == 1234
    assert _value(f, "fedlt_audit_chain_verified", **main) == 1
    info = _value(f, "fedlt_consortium_info", method="fedavg", **main)
    assert info == 1  # an info metric: a gauge of 1 in this format, its facts in the labels


def test_two_studies_each_have_their_own_series_and_the_aggregators_facts_appear_once(scraped_page):
    f = _scraped(scraped_page)
    aggregator_wide = {"fedlt_studies", "fedlt_certificate_warnings"}
    for name, family in f.items():
        studies = {s.labels.get("study") for s in family.samples}
        if name in aggregator_wide:
            assert studies == {None}, name
        elif family.samples:
            assert studies <= {"main", "imaging"}, name
    assert f["fedlt_studies"].type == "gauge"
    by_state = {s.labels["state"]: s.value for s in f["fedlt_studies"].samples}
    assert by_state == {state: {"running": 2, "queued": 1, "done": 1}.get(state, 0) for state in STATES}
    (warnings,) = f["fedlt_certificate_warnings"].samples
    assert (warnings.labels, warnings.value) == ({}, 1)
    imaging = {"study": "imaging"}
    info = {s.labels["study"]: s.labels for s in f["fedlt_consortium_info"].samples}
    assert info["imaging"] == {
        "study": "imaging",
        "consortium": "st-test",
        "method": "fedprox",
        "privacy": "ckks",
    }
    assert info["main"]["method"] == "fedavg"
    for name, main, other in (
        ("fedlt_rounds_committed_total", 2, 1),
        ("fedlt_rounds_planned", 5, 2),
        ("fedlt_silos_registered", 2, 2),
        ("fedlt_state_bytes", 1234, 99),
        ("fedlt_dropouts_total", 2, 0),
        ("fedlt_contributions_total", 2, 2),
        ("fedlt_round_duration_seconds_count", 2, 1),
        ("fedlt_round_duration_seconds_sum", 12.0, 50.0),
    ):
        found = {
            s.labels["study"]: s.value for family in f.values() for s in family.samples if s.name == name
        }
        assert found == {"main": main, "imaging": other}, name
    assert _value(f, "fedlt_silo_connected", silo="gamma", **imaging) == 0
    assert _value(f, "fedlt_silo_last_contributed_round", silo="alpha", **imaging) == 1
    left = {(s.labels["study"], s.labels["silo"]): s.value for s in f["fedlt_epsilon_remaining"].samples}
    assert left == {("main", "alpha"): 6.5, ("imaging", "alpha"): 2.25}  # beta and gamma report none
    assert not [s for s in f["fedlt_refusals"].samples if s.labels["study"] == "imaging"]
    assert _value(f, "fedlt_attempts", "fedlt_attempts_total", outcome="aborted", **imaging) == 0
    accuracy = {s.labels["study"] for name in ("fedlt_test_accuracy", "fedlt_test_accuracy_round")
                for s in f[name].samples}  # fmt: skip
    assert accuracy == {"main"}  # imaging has no evaluated round: no sample, not 0


def test_a_scrape_without_the_token_or_under_another_host_name_reads_nothing(scraped_page):
    host, port = scraped_page.server.server_address[:2]
    token = scraped_page.token_file.read_text().strip()
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": f"Basic {token}"}):
        status, _, text = _scrape(host, port, headers)
        assert status == 401
        assert "fedlt_" not in text
    rebound = {"Authorization": f"Bearer {token}", "Host": f"attacker.example:{port}"}
    status, _, text = _scrape(host, port, rebound)
    assert status == 421
    assert "fedlt_" not in text


def test_without_dp_in_the_plan_no_silos_epsilon_is_shown_as_this_studys(store):
    facts = study_facts(_config(dp=False), _inbox(), store, study="main")
    text = exposition(ConsortiumCollector([facts], states={}, certificate_warnings=0)).decode()
    assert "fedlt_epsilon_remaining{" not in text


def test_an_aggregator_with_no_study_running_still_says_what_waits(store):
    """Every study queued: no study's series, the states and the warnings all the same."""
    queued = [StudyInfo("later", "queued", "", 0, 0, 0, False)]
    f = _families(
        exposition(ConsortiumCollector([], states=study_states(queued), certificate_warnings=0)).decode()
    )
    assert _value(f, "fedlt_studies", state="queued") == 1
    assert _value(f, "fedlt_certificate_warnings") == 0
    assert not f["fedlt_rounds_committed"].samples


def test_a_status_page_without_metrics_has_no_metrics_path(tmp_path):
    page = _page(tmp_path)
    try:
        host, port = page.server.server_address[:2]
        token = page.token_file.read_text().strip()
        assert _scrape(host, port, {"Authorization": f"Bearer {token}"})[0] == 404
    finally:
        page.stop()


def test_each_rounds_tensorboard_facts_come_from_the_audit_log_and_the_silos_reports(store):
    facts = RoundFacts(store, dp=True)
    assert facts(1) == {"silos/invited": 2, "silos/counted": 1, "silos/dropouts": 1}  # no round table yet
    facts.rounds = SimpleNamespace(inbox=_inbox(), table=_inbox(99).table)
    assert facts(2) == {
        "silos/invited": 2,
        "silos/counted": 1,
        "silos/dropouts": 1,
        "bytes/state": 99,
        "privacy/epsilon_remaining/alpha": 6.5,
    }
    assert "silos/invited" not in facts(0)  # the initial model: no round made it


def test_monitoring_settings_are_checked_with_the_way_out(tmp_path, monkeypatch):
    path = tmp_path / "consortium.toml"
    path.write_text(
        render_toml({"monitoring": {"mlflow_uri": "http://127.0.0.1:5000", "mlflow_experiment": ""}})
    )
    with pytest.raises(ConfigError, match=r"monitoring\.mlflow_experiment: name the MLflow experiment"):
        load_consortium_config(path)
    path.write_text(render_toml({"monitoring": {"tensorbord": False}}))
    with pytest.raises(ConfigError, match=r"monitoring\.tensorbord"):
        load_consortium_config(path)
    path.write_text(render_toml({"monitoring": {"mlflow_uri": "http://127.0.0.1:5000", "mlflow_run": "x"}}))
    monitoring = load_consortium_config(path).monitoring
    assert (monitoring.mlflow_run, monitoring.tensorboard) == ("x", True)
    monkeypatch.setattr("aggregator.config.mlflow_installed", lambda: False)
    with pytest.raises(
        ConfigError, match=r"the mlflow package is not installed here: pip install 'fedlt\[mlflow\]'"
    ):
        load_consortium_config(path)


# --- a silo agent's own endpoint --------------------------------------------------------------------------


@pytest.fixture
def kit(tmp_path) -> tuple[Path, list[Path]]:
    configs = write_kit(tmp_path)
    for path in configs:  # a new silo's policy, pointing at an address where no aggregator answers
        tree = read_toml(path)
        del tree["policy"]
        tree["connection"]["aggregator"] = "127.0.0.1:1"
        path.write_text(render_toml(tree))
    return tmp_path, configs


def _monitored(path: Path, **monitoring: object) -> Path:
    tree = read_toml(path)
    tree["monitoring"] = monitoring
    path.write_text(render_toml(tree))
    return path


def test_a_silos_endpoint_is_off_by_default(kit):
    _, configs = kit
    config = load_silo_config(configs[0])
    assert config.monitoring.prometheus == ""
    agent = SiloAgent(config)
    try:
        assert agent.metrics_endpoint is None
    finally:
        agent.state_lock.release()


def test_a_silos_endpoint_serves_what_the_silo_knows_while_it_runs(kit):
    """Configured: served while the agent runs (here it retries an aggregator that is not there), with
    its refusals by code, rounds, ε spent and budget; a request naming another host is refused."""
    root, configs = kit
    stop = threading.Event()
    agent = SiloAgent(load_silo_config(_monitored(configs[0], prometheus="127.0.0.1:0")), stop=stop)
    agent.standing.silo_id = "silo-0"
    agent.standing.aggregator_pem = (root / "pki" / "aggregator.pem").read_bytes()
    agent.take_round(SiloTransport(RecordingStub()), signed_spec(root, privacy="ckks"))  # refused: policy
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        host, port = agent.metrics_endpoint.server.server_address[:2]
        status, kind, text = _scrape(host, port, {})
        assert status == 200
        assert kind.startswith("text/plain; version=0.0.4")
        f = _families(text)
        assert _value(f, "fedlt_silo_refusals", "fedlt_silo_refusals_total", code="policy") == 1
        assert _value(f, "fedlt_silo_refusals", "fedlt_silo_refusals_total", code="budget") == 0
        assert _value(f, "fedlt_silo_rounds_taken_part", "fedlt_silo_rounds_taken_part_total") == 0
        assert _value(f, "fedlt_silo_epsilon_spent") == 0
        assert _value(f, "fedlt_silo_epsilon_budget") == 8.0
        assert _value(f, "fedlt_silo_connected") == 0
        assert _scrape(host, port, {"Host": f"attacker.example:{port}"})[0] == 421
    finally:
        stop.set()
        running.join(LIMIT)
        agent.state_lock.release()
    assert not running.is_alive()


def test_a_silos_endpoint_stays_on_loopback_unless_its_administrator_says_otherwise(kit):
    _, configs = kit
    with pytest.raises(ConfigError, match="not a loopback address and the endpoint has no authentication"):
        load_silo_config(_monitored(configs[0], prometheus="0.0.0.0:9465"))
    opened = load_silo_config(_monitored(configs[0], prometheus="0.0.0.0:9465", prometheus_remote=True))
    assert opened.monitoring.prometheus_remote
    with pytest.raises(ConfigError, match="expected host:port"):
        load_silo_config(_monitored(configs[0], prometheus="9465"))


def test_a_port_in_use_stops_the_agent_at_its_start_saying_so(kit):
    _, configs = kit
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            SiloAgent(load_silo_config(_monitored(configs[0], prometheus=f"127.0.0.1:{port}")))


def test_the_metrics_server_answers_get_on_metrics_only():
    server = MetricsServer("127.0.0.1:0", lambda: b"fedlt_x 1\n").start()
    try:
        host, port = server.server.server_address[:2]
        connection = http.client.HTTPConnection(host, port, timeout=LIMIT)
        connection.request("POST", "/metrics", body=b"")
        assert connection.getresponse().status == 405
        connection = http.client.HTTPConnection(host, port, timeout=LIMIT)
        connection.request("GET", "/")
        assert connection.getresponse().status == 404
    finally:
        server.stop()
