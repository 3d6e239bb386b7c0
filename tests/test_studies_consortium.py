"""Two studies at once on one aggregator, three silo agents each taking part in both (real processes).

What it must show: the operator creates a second study on a running aggregator with the study command; the
two studies, with different methods and privacy layers, run at the same time over one gRPC server and the
same silo agents; each one's committed states are its own simulator's to the bit; each keeps its own store
and audit chain. And the one DP ledger of a silo: once one study spent the silo's budget, the other's work
is refused, whatever study label it comes under.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import tomllib
from dataclasses import replace

import pytest
import torch

from fedlt.config import render_toml
from fedlt.dp import DPSettings
from fedlt.methods import METHODS
from fedlt.plan import MethodChoice
from silo.budget import PRIVACY_LEDGER
from tests.consortium_harness import ENV, PLAN, Consortium
from tests.test_consortium import (  # noqa: F401 (make_consortium is a fixture)
    assert_same_model,
    make_consortium,
    simulated_run,
    simulated_state,
)

ROUNDS = 2
CCVR = replace(PLAN, method=MethodChoice("ccvr", METHODS["ccvr"].Options()))


def study_file(kit: Consortium, study: str, **changes: dict) -> str:
    """A study file made from the consortium's own file: its sections without [server], changed as asked."""
    tree = tomllib.loads((kit.directory / "consortium.toml").read_text())
    tree.pop("server")  # and what else is the aggregator's, for every study
    tree["consortium"].pop("exit_when_done")
    tree["timeouts"].pop("keepalive", None)
    for section, settings in changes.items():
        # another method is another method's options: its table replaced, not merged
        tree[section] = settings if section == "method" else {**tree.get(section, {}), **settings}
    path = kit.directory / f"{study}.toml"
    path.write_text(render_toml(tree))
    return str(path)


def join_studies(consortium: Consortium, studies: dict[str, dict]) -> None:
    """Each silo's config takes part in `studies`, each with its own policy section where given."""
    for path in consortium.silo_configs:
        tables = {
            "study": {study: ({"policy": policy} if policy else {}) for study, policy in studies.items()}
        }
        path.write_text(path.read_text() + "\n" + render_toml(tables))


def operator(consortium: Consortium, *arguments: str) -> subprocess.CompletedProcess:
    """`python -m aggregator study ...` as the operator runs it, with the kit's operator certificate."""
    pki = consortium.directory / "pki"
    command = [
        sys.executable,
        "-m",
        "aggregator",
        "study",
        arguments[0],
        "--config",
        str(consortium.directory / "consortium.toml"),
        "--cert",
        str(pki / "operator.pem"),
        "--key",
        str(pki / "operator.key"),
        *arguments[1:],
    ]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120, check=False)


def committed_states(consortium: Consortium, study: str = "") -> list[tuple[int, str]]:
    store = consortium.store(study)
    try:
        return store._db.execute("SELECT round, digest FROM states ORDER BY round").fetchall()
    finally:
        store.close()


def test_two_studies_with_different_methods_and_layers_run_at_once_each_as_its_simulator(
    make_consortium,  # noqa: F811
    tmp_path,
):
    consortium = make_consortium(rounds=ROUNDS, min_silos=3, plan=CCVR)
    imaging = study_file(
        consortium,
        "imaging",
        consortium={"privacy": "blind"},
        method={"name": "fedavg"},
        blind={"key_holder": "silo-0"},
    )
    join_studies(consortium, {"main": {}, "imaging": {"methods": ["fedavg"], "privacy": ["blind"]}})
    consortium.start_aggregator()
    created = operator(consortium, "create", "--id", "imaging", "--plan", imaging)
    assert created.returncode == 0, created.stdout + created.stderr
    for k in range(len(consortium.silo_configs)):
        consortium.start_silo(k)
    assert consortium.wait_aggregator(timeout=400) == 0, "\n".join(consortium.output[-40:])

    # the default study: CCVR over secagg, the secagg simulator's state to the bit
    final = consortium.final_state()
    expected = simulated_state(tmp_path / "main", rounds=ROUNDS, method=CCVR.method)
    assert final.round == ROUNDS + 1  # CCVR's closing statistics round
    assert_same_model(final, expected, atol=0)
    for key in expected.extra:
        assert torch.equal(final.extra[key], expected.extra[key]), key

    # the created study: FedAvg over blind, stepped by the silos; secagg's simulator state digests to the bit
    secagg = simulated_run(tmp_path / "imaging", rounds=ROUNDS, privacy="secagg")
    states = committed_states(consortium, "imaging")
    assert [r for r, _ in states] == list(range(ROUNDS + 1))
    assert [d for r, d in states if r > 0] == [m["state_digest"] for m in secagg.metrics["rounds"]]

    # both ran at once: each study was running before the other's last round committed (whether their rounds
    # also interleave is the silos' timing: on a busy machine one study's two rounds may fit in a gap)
    started = {study: _started_ms(consortium, study) for study in ("", "imaging")}
    ended = {study: _last_commit_ms(consortium, study) for study in ("", "imaging")}
    assert started[""] < ended["imaging"], (started, ended)
    assert started["imaging"] < ended[""], (started, ended)

    listed = operator(consortium, "list")  # the aggregator has exited: the command says so, exit 1
    assert listed.returncode == 1
    assert "no aggregator answers" in listed.stderr
    assert _catalog_states(consortium) == {"main": "done", "imaging": "done"}


@pytest.mark.slow  # 38 s alone; tests/test_silo_studies.py checks two agents' one budget by default
def test_a_silos_one_ledger_refuses_the_second_studys_work_once_the_first_spent_its_budget(
    make_consortium,  # noqa: F811
):
    """Both studies under [dp] at ε 6 each, every silo's budget ε 6: the first study spends it; the second,
    created afterwards on the same aggregator, is refused by every silo's ledger (code budget) before any
    training, and the operator cancels it."""
    dp_plan = replace(PLAN, dp=DPSettings(enabled=True, epsilon=6.0))
    consortium = make_consortium(rounds=ROUNDS, min_silos=3, plan=dp_plan)
    second = study_file(consortium, "second", consortium={"seed": 7})
    join_studies(consortium, {"main": {}, "second": {}})
    for path in consortium.silo_configs:
        path.write_text(path.read_text() + "\n[dp]\nepsilon = 6.0\n")
    text = (consortium.directory / "consortium.toml").read_text()
    (consortium.directory / "consortium.toml").write_text(
        text.replace("exit_when_done = true", "exit_when_done = false")
    )
    consortium.start()
    consortium.wait_for_output(lambda line: line == "all rounds committed", timeout=300)
    created = operator(consortium, "create", "--id", "second", "--plan", second)
    assert created.returncode == 0, created.stdout + created.stderr
    refusals = _wait_for_refusals(consortium, "second", silos=3)
    assert {r["code"] for r in refusals} == {"budget"}, refusals
    cancelled = operator(consortium, "cancel", "--id", "second", "--reason", "budget spent")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    for k in range(3):
        entries = json.loads((consortium.directory / f"silo-{k}-state" / PRIVACY_LEDGER).read_text())[
            "entries"
        ]
        assert len({e["run"] for e in entries}) == 1  # the first study's plan: nothing for the second
        assert 0 < entries[-1]["epsilon_after"] <= 6.0


def _catalog_states(consortium: Consortium) -> dict[str, str]:
    db = sqlite3.connect(consortium.data_dir / "studies.sqlite")
    try:
        return dict(db.execute("SELECT id, state FROM studies").fetchall())
    finally:
        db.close()


def _started_ms(consortium: Consortium, study: str) -> int:
    store = consortium.store(study)
    try:
        return min(r.at_ms for r in store.audit_log() if r.event == "study_started")
    finally:
        store.close()


def _last_commit_ms(consortium: Consortium, study: str) -> int:
    store = consortium.store(study)
    try:
        return max(r.at_ms for r in store.audit_log() if r.event == "round_committed")
    finally:
        store.close()


def _wait_for_refusals(consortium: Consortium, study: str, silos: int) -> list[dict]:
    until = time.monotonic() + 240
    while time.monotonic() < until:
        store = consortium.store(study)
        try:
            found = [r.detail for r in store.audit_log() if r.event == "round_refused"]
        finally:
            store.close()
        if len({r["silo"] for r in found}) >= silos:
            return found
        time.sleep(1)
    raise AssertionError(
        f"fewer than {silos} silos refused study {study!r}:\n" + "\n".join(consortium.output[-30:])
    )
