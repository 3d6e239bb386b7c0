"""One aggregator, several studies: the catalog, the queue and its slots, the operator's commands on a real
aggregator (in this process, over mutual TLS), the status page's list, and a single run's data directory
becoming the default study. No silo takes part here (tests/test_studies_consortium.py runs them)."""

from __future__ import annotations

import json
import re
import threading
import tomllib
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from aggregator.__main__ import main as aggregator_main
from aggregator.catalog import CATALOG, BadStudy, Catalog, StudyInfo, UnknownStudy, WrongState, study_text
from aggregator.config import load_consortium_config, load_study_config
from aggregator.server import derive_audit_key, serve
from aggregator.store import DATABASE, AuditKey, Store, StoreError
from aggregator.studies import dormant_status
from fedlt.config import render_toml
from privacy.pki.signing import load_private_key
from tests.consortium_harness import write_kit


def test_the_catalog_numbers_the_queue_and_moves_studies_only_as_allowed(tmp_path):
    catalog = Catalog(tmp_path / CATALOG)
    catalog.add("main", "", is_default=True)
    catalog.add("b", "x = 1")
    catalog.add("c", "x = 2")
    catalog.set_state("main", "running")
    assert [(s.id, s.queue_position) for s in catalog.studies()] == [("main", 0), ("b", 1), ("c", 2)]
    with pytest.raises(WrongState, match="is running"):
        catalog.set_state("main", "queued", allowed=("paused",))
    with pytest.raises(UnknownStudy):
        catalog.set_state("nope", "paused")
    catalog.keep_progress("b", {"method": "fedavg", "committed_rounds": 3})
    assert catalog.info("b").committed_rounds == 3
    assert catalog.default() == "main"
    catalog.close()
    assert study_text(tmp_path, "b") == "x = 1"
    assert study_text(tmp_path, "main") is None


def _kit(tmp_path: Path, **server: object) -> Path:
    write_kit(tmp_path)
    path = tmp_path / "consortium.toml"
    tree = tomllib.loads(path.read_text())
    tree["server"].update(server)
    tree["consortium"]["exit_when_done"] = False
    tree["monitoring"] = {"tensorboard": False}
    path.write_text(render_toml(tree))
    return path


def _study_file(config: Path, directory: Path, name: str, **consortium: object) -> Path:
    tree = tomllib.loads(config.read_text())
    tree.pop("server")  # and what else is the aggregator's, for every study
    tree["consortium"].pop("exit_when_done")
    tree["timeouts"].pop("keepalive", None)
    tree["consortium"].update(consortium)
    path = directory / f"{name}.toml"
    path.write_text(render_toml(tree))
    return path


class Serving:
    """`python -m aggregator serve` in a thread of this process, stopped by the test."""

    def __init__(self, config: Path) -> None:
        self.config, self.stop, self.output = config, threading.Event(), []
        data_dir = load_consortium_config(config).path("aggregator-data")
        self.listening = data_dir / "listening.json"
        self.listening.unlink(missing_ok=True)  # a restart's, once it listens
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        for _ in range(600):
            if self.listening.exists() or not self.thread.is_alive():
                break
            self.stop.wait(0.1)
        assert self.listening.exists(), self.output

    def _serve(self) -> None:
        self.code = serve(load_consortium_config(self.config), stop=self.stop, echo=self.output.append)

    def operator(self, capsys, *arguments: str) -> tuple[int, str]:
        pki = self.config.parent / "pki"
        options = ["--config", str(self.config), "--cert", str(pki / "operator.pem")]
        options += ["--key", str(pki / "operator.key")]
        command, *rest = arguments
        capsys.readouterr()
        code = aggregator_main(
            [*(["study", command] if command != "status" else ["status"]), *options, *rest]
        )
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


@pytest.fixture
def serving(tmp_path):
    made: list[Serving] = []

    def start(config: Path) -> Serving:
        made.append(Serving(config))
        return made[-1]

    yield start
    for s in made:
        s.stop.set()
        s.thread.join(60)


def _states(served: Serving, capsys) -> dict[str, str]:
    code, shown = served.operator(capsys, "list")
    assert code == 0, shown
    rows = [re.split(r"\s{2,}", line.strip()) for line in shown.splitlines()[1:] if line.strip()]
    return {row[0].split()[0]: re.split(r"[\s:]", row[3])[0] for row in rows}


def test_one_slot_runs_one_study_the_rest_queue_and_the_operator_moves_them(tmp_path, serving, capsys):
    config = _kit(tmp_path, max_studies=1, status_page="127.0.0.1:0")
    served = serving(config)
    second = _study_file(config, tmp_path, "second", seed=1)
    code, shown = served.operator(capsys, "create", "--id", "second", "--plan", str(second))
    assert code == 0, shown
    assert "queued" in shown
    code, shown = served.operator(capsys, "create", "--id", "second", "--plan", str(second))
    assert code == 1
    assert "exists already" in shown
    assert _states(served, capsys) == {"main": "running", "second": "queued"}

    code, shown = served.operator(capsys, "pause", "--id", "main")  # its slot goes to the next study
    assert code == 0, shown
    assert _states(served, capsys) == {"main": "paused", "second": "running"}
    code, shown = served.operator(capsys, "resume", "--id", "main")
    assert code == 0, shown
    assert _states(served, capsys) == {"main": "queued", "second": "running"}
    code, shown = served.operator(capsys, "cancel", "--id", "second", "--reason", "wrong cohort")
    assert code == 0, shown
    assert _states(served, capsys) == {"main": "running", "second": "cancelled"}
    code, shown = served.operator(capsys, "resume", "--id", "second")
    assert code == 1
    assert "cancelled" in shown
    code, shown = served.operator(capsys, "pause", "--id", "nope")
    assert code == 1
    assert "no study 'nope'" in shown

    page = json.loads(served.listening.read_text())
    token = Path(page["status_page_token"]).read_text().strip()
    request = urllib.request.Request(f"{page['status_page']}/status.json")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as answer:
        status = json.load(answer)
    assert [(s["id"], s["state"]) for s in status["studies"]] == [
        ("main", "running"),
        ("second", "cancelled"),
    ]
    assert status["committed_rounds"] == 0  # the default study's, where a single run's page had them
    served.close()

    # each study keeps its own audit chain, with the operator's changes and the operator's name
    key = derive_audit_key(load_private_key(tmp_path / "pki" / "aggregator.key"))
    store = Store(tmp_path / "aggregator-data" / "studies" / "second" / DATABASE, audit_key=key)
    store.verify_audit()
    events = [(r.event, r.detail.get("by")) for r in store.audit_log() if r.event.startswith("study_")]
    store.close()
    assert events[0] == ("study_created", "operator")
    assert ("study_cancelled", "operator") in events


def test_a_study_file_is_checked_whole_and_names_no_server(tmp_path):
    config = load_consortium_config(_kit(tmp_path))
    with pytest.raises(BadStudy) as raised:
        load_study_config(
            "Bad Id",
            '[server]\nlisten = "0.0.0.0:1"\n[consortium]\nid = "other"\nrounds = 0\nexit_when_done = false\n'
            "[timeouts]\nkeepalive = 60.0\n",
            config,
        )
    problems = "\n".join(raised.value.problems)
    assert "[model]: a study file names its model" in problems
    assert "study id" in problems
    assert "[server]" in problems
    assert "consortium.id" in problems
    assert "consortium.rounds" in problems
    assert "consortium.exit_when_done: the aggregator's" in problems
    assert "timeouts.keepalive: the aggregator's" in problems
    entry = '[model]\nname = "hospital_models.resnet:build"\n'
    with pytest.raises(BadStudy, match="study_models"):  # the aggregator would import and call it
        load_study_config("b", entry, config)
    listed = replace(config, server=replace(config.server, study_models=("hospital_models.resnet:build",)))
    assert load_study_config("b", entry, listed).plan.model.name == "hospital_models.resnet:build"
    study = load_study_config("b", '[consortium]\nrounds = 3\n[model]\nname = "cnn-small"\n', config)
    assert study.server.data_dir == str(Path("aggregator-data") / "studies" / "b")
    assert study.consortium.id == config.consortium.id


def test_a_single_runs_data_directory_becomes_the_default_study_and_goes_on(tmp_path, serving, capsys):
    config = _kit(tmp_path)
    served = serving(config)
    served.close()
    data_dir = tmp_path / "aggregator-data"
    (data_dir / CATALOG).unlink()  # what a data directory of a single run looks like: its store alone
    key = derive_audit_key(load_private_key(tmp_path / "pki" / "aggregator.key"))
    store = Store(data_dir / DATABASE, audit_key=key)
    before = len(store.audit_log())
    digest = store.latest_state().digest
    store.close()

    served = serving(config)
    assert _states(served, capsys) == {"main": "running"}
    served.close()
    store = Store(data_dir / DATABASE, audit_key=key)
    store.verify_audit()
    assert store.latest_state().digest == digest  # the same run, not a new one
    assert len(store.audit_log()) > before
    store.close()


def test_consortium_tomls_own_study_on_a_store_of_other_settings_stops_the_aggregator_saying_so(
    tmp_path, serving
):
    """As a single run did: the default study is the operator's file, so a mismatch is the operator's to fix
    now, not a study left failed behind a running service."""
    config = _kit(tmp_path)
    serving(config).close()
    config.write_text(config.read_text().replace("seed = 0", "seed = 5"))
    with pytest.raises(StoreError, match="other settings"):
        serve(load_consortium_config(config), stop=threading.Event(), echo=lambda _: None)
    config.write_text(config.read_text().replace("seed = 5", "seed = 0"))
    serving(config).close()  # the lock on the data directory was let go


def test_a_study_not_running_shows_each_silos_last_counted_round_from_its_audit_log(tmp_path):
    store = Store(tmp_path / DATABASE, audit_key=AuditKey(b"k" * 32))
    store.register_silo("silo-0", "00", "test", {})
    store.register_silo("silo-1", "11", "test", {})
    for round_number, counted in ((1, ["silo-0", "silo-1"]), (2, ["silo-0"])):
        store.audit("attempt_started", {"round_id": f"r{round_number}", "participants": ["silo-0", "silo-1"]})
        store.audit(
            "round_committed",
            {"round_id": f"r{round_number}", "round": round_number, "contributors": counted},
        )
    info = StudyInfo("b", "paused", "", 2, 0, 0, False, committed_rounds=2)
    shown = {s["silo_id"]: s["last_contributed_round"] for s in dormant_status(store, info)["silos"]}
    store.close()
    assert shown == {"silo-0": 2, "silo-1": 1}


def test_a_study_whose_store_is_broken_fails_naming_it_and_resumes_once_it_is_mended(
    tmp_path, serving, capsys
):
    config = _kit(tmp_path)
    served = serving(config)
    second = _study_file(config, tmp_path, "second", seed=1)
    assert served.operator(capsys, "create", "--id", "second", "--plan", str(second))[0] == 0
    assert served.operator(capsys, "pause", "--id", "second")[0] == 0
    store = tmp_path / "aggregator-data" / "studies" / "second" / DATABASE
    kept = store.read_bytes()
    store.write_bytes(b"not a database" * 100)  # a disk fault, or a bad restore
    code, shown = served.operator(capsys, "resume", "--id", "second")
    assert code == 1
    assert str(store) in shown  # named, not an internal error
    assert _states(served, capsys)["second"] == "paused"  # as it was: resume can be tried again
    store.write_bytes(kept)
    code, shown = served.operator(capsys, "resume", "--id", "second")
    assert code == 0, shown
    assert _states(served, capsys)["second"] == "running"
    served.close()


def test_an_aggregator_with_nothing_to_run_says_why_it_stops(tmp_path, serving):
    config = _kit(tmp_path)
    serving(config).close()
    catalog = Catalog(tmp_path / "aggregator-data" / CATALOG)
    catalog.set_state("main", "failed", "stopped on an error: the disk was full")
    catalog.close()
    config.write_text(config.read_text().replace("exit_when_done = false", "exit_when_done = true"))
    said: list[str] = []
    assert serve(load_consortium_config(config), stop=threading.Event(), echo=said.append) == 0
    assert "study 'main' failed: stopped on an error: the disk was full" in said
    assert any(line.startswith("nothing runs or waits on this aggregator") for line in said)
