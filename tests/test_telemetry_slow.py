"""Metrics where operators look, end to end (`make test-all`): a real MLflow tracking server started here on
127.0.0.1 (it takes 15-30 s to start), and a real consortium whose aggregator is killed and started again
mid-run, read back by TensorBoard's reader and scraped by `prometheus_client`'s parser."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prometheus_client.parser import text_string_to_metric_families

from aggregator.config import ConsortiumConfig, ConsortiumSection, MonitoringSection
from aggregator.store import Store
from aggregator.study_run import RoundFacts, study_telemetry
from fedlt.config import read_toml, render_toml
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import run_simulation
from fedlt.studies import DEFAULT_STUDY
from fedlt.telemetry import TENSORBOARD
from tests.consortium_harness import Consortium
from tests.test_telemetry import AUDIT_KEY, FAST, _expected, _scalars

pytestmark = pytest.mark.slow

STARTUP = 180.0  # seconds the tracking server may take to answer its health check on a busy machine
EXPERIMENT = "fedlt-tests"


@pytest.fixture
def tracking_server(tmp_path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with a SQLite store in tmp_path; stopped, with its workers, at the end."""
    with socket.socket() as probe:  # mlflow takes no port 0: a free port, taken from the OS just before
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
            *("--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.sqlite'}", "--workers", "1"),
            *("--default-artifact-root", str(tmp_path / "artifacts")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the uvicorn worker it starts is stopped with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, tmp_path / "mlflow-server.log")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    until = time.monotonic() + STARTUP
    while time.monotonic() < until:
        if server.poll() is not None:
            raise AssertionError(f"mlflow server exited with {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        threading.Event().wait(0.25)
    raise AssertionError(f"mlflow server did not answer within {STARTUP} s:\n{log.read_text()}")


def _history(client: MlflowClient, run_id: str, tag: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))


def test_the_simulator_logs_each_round_once_to_mlflow_across_a_resume(tracking_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
    out = tmp_path / "digits-run"
    run_simulation(load_sim_config(None, {**FAST, "rounds": 2}), out, echo=lambda _: None)
    run_simulation(load_sim_config(None, {**FAST, "rounds": 3}), out, echo=lambda _: None)  # resumed
    client = MlflowClient(tracking_uri=tracking_server)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert run.info.run_name == "digits-run"
    assert run.info.status == "FINISHED"
    assert run.data.tags["fedlt.last_step"] == "3"
    metrics = json.loads((out / "metrics.json").read_text())
    for tag, series in _expected(metrics).items():
        assert _history(client, run.info.run_id, tag) == [(s, pytest.approx(v)) for s, v in series], tag


def test_the_aggregator_logs_its_rounds_and_their_silos_to_the_mlflow_run_its_config_names(
    tracking_server, tmp_path
):
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    try:
        store.save_initial_state("d0", b"w")
        _, round_id = store.begin_attempt(1, ["alpha", "beta", "gamma"], "n1")
        store.commit_round(round_number=1, round_id=round_id, digest="d1", data=b"w", contributors=["alpha"])
        config = ConsortiumConfig(
            consortium=ConsortiumSection(id="st-test"),
            monitoring=MonitoringSection(mlflow_uri=tracking_server, mlflow_experiment=EXPERIMENT),
        )
        telemetry = study_telemetry(config, tmp_path, [], ("a", "b"), RoundFacts(store, dp=False))
        telemetry.record({"round": 1, "accuracy": 0.75, "per_class": [0.5, 1.0], "seconds": 2.5}, ("a", "b"))
        telemetry.close()
    finally:
        store.close()
    client = MlflowClient(tracking_uri=tracking_server)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert run.info.run_name == "st-test"
    expected = {
        "accuracy/overall": 0.75,
        "accuracy/class/a": 0.5,
        "accuracy/class/b": 1.0,
        "round/seconds": 2.5,
        "silos/invited": 3,
        "silos/counted": 1,
        "silos/dropouts": 2,
    }
    assert {tag: _history(client, run.info.run_id, tag) for tag in expected} == {
        tag: [(1, value)] for tag, value in expected.items()
    }
    assert _scalars(tmp_path / TENSORBOARD)["silos/dropouts"] == [(1, 2.0)]  # and TensorBoard, by default


def test_a_consortium_restarted_mid_run_writes_each_round_once_and_serves_its_metrics(tmp_path):
    consortium = Consortium.create(tmp_path, rounds=3, min_silos=3, tensorboard=True)
    path = tmp_path / "consortium.toml"
    path.write_text(path.read_text().replace("exit_when_done = true", "exit_when_done = false"))
    silo = read_toml(consortium.silo_configs[0])
    silo["monitoring"] = {"prometheus": "127.0.0.1:0"}
    consortium.silo_configs[0].write_text(render_toml(silo))
    try:
        consortium.start()
        consortium.wait_for_output(lambda line: line.startswith("round    1/3"), timeout=180)
        consortium.wait_for_silo_log(0, "metrics for Prometheus at ")
        log = (tmp_path / "silo-0.log").read_text()
        (url,) = re.findall(r"metrics for Prometheus at (http://\S+)", log)
        with urllib.request.urlopen(url, timeout=30) as answer:  # while silo-0 runs: it exits once finished
            silo_metrics = _families(answer.read().decode())
        assert silo_metrics["fedlt_silo_rounds_taken_part_total"] >= 1
        assert silo_metrics["fedlt_silo_last_contact_timestamp_seconds"] > 0
        assert silo_metrics["fedlt_silo_epsilon_spent"] == 0  # the plan has no [dp]
        consortium.kill(consortium.aggregator)
        consortium.output.clear()
        consortium.start_aggregator()
        consortium.wait_for_output(lambda line: line.startswith("round    3/3"), timeout=300)
        aggregator = _scrape_aggregator(consortium.data_dir)
        assert aggregator["fedlt_rounds_committed_total"] == 3
        assert aggregator["fedlt_test_accuracy_round"] == 3
        assert aggregator["fedlt_silos_registered"] == 3
        assert aggregator["fedlt_audit_chain_verified"] == 1
        store = consortium.store()
        try:
            history = store.metrics_history()
        finally:
            store.close()
    finally:
        consortium.stop()
    found = _scalars(consortium.data_dir / TENSORBOARD)
    steps = [entry["round"] for entry in history]
    assert steps == [1, 2, 3]
    assert [s for s, _ in found["accuracy/overall"]] == steps  # each once, across the restart
    assert found["accuracy/overall"] == [
        (e["round"], pytest.approx(e["accuracy"], rel=1e-6)) for e in history
    ]
    assert [s for s, _ in found["silos/counted"]] == steps


def _scrape_aggregator(data_dir: Path) -> dict[str, float]:
    listening = json.loads((data_dir / "listening.json").read_text())
    host, port = listening["status_page"].removeprefix("http://").rstrip("/").rsplit(":", 1)
    token = Path(listening["status_page_token"]).read_text().strip()
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
    response = connection.getresponse()
    assert response.status == 200
    return _families(response.read().decode())


def _families(text: str) -> dict[str, float]:
    """Each unlabelled sample's value, by sample name."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels in ({}, {"study": DEFAULT_STUDY})
    }
