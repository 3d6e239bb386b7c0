"""Differential privacy in the consortium: silos train and release under their own ledgers, refuse what the
aggregator's plan would overspend, and tell the operator their remaining budget only if they choose to."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

from aggregator.round_table import Sessions
from aggregator.status import render
from fedlt.dp import DPSettings
from fedlt.methods import METHODS, ModelSpec
from fedlt.v1 import operator_pb2
from privacy.dp import Budget, BudgetExceeded, PrivacyLedger, SiloPrivacy
from privacy.dp.noise import SecureRandom
from silo.__main__ import main as silo_main
from silo.budget import PRIVACY_LEDGER
from silo.config import DPSection
from tests.consortium_harness import PLAN, Consortium

DP_PLAN = replace(PLAN, dp=DPSettings(enabled=True, epsilon=6.0))


@pytest.fixture
def consortium(tmp_path):
    made = Consortium.create(tmp_path / "c", rounds=2, min_silos=3, plan=DP_PLAN)
    yield made
    made.stop()


def _with_budget(config, epsilon: float, *, report: bool = False) -> None:
    text = config.read_text()
    config.write_text(f"{text}\n[dp]\nepsilon = {epsilon}\nreport = {str(report).lower()}\n")


def test_a_dp_consortium_trains_and_every_silo_keeps_its_own_ledger(consortium, capsys):
    for k, config in enumerate(consortium.silo_configs):
        _with_budget(config, 6.0, report=k == 0)
    consortium.start()
    assert consortium.wait_aggregator(timeout=300) == 0, "\n".join(consortium.output[-30:])
    consortium.stop()

    for k, config in enumerate(consortium.silo_configs):
        path = config.parent / f"silo-{k}-state" / PRIVACY_LEDGER
        entries = json.loads(path.read_text())["entries"]
        mechanisms = [e["mechanism"] for e in entries]
        assert mechanisms.count("dp-sgd") == 2, mechanisms  # one charge per round, retries resend
        assert mechanisms.count("gaussian") == 1, mechanisms  # the counts, noised once
        assert 0 < entries[-1]["epsilon_after"] <= 6.0
    capsys.readouterr()
    assert silo_main(["budget", "--config", str(consortium.silo_configs[0])]) == 0
    shown = capsys.readouterr().out
    assert "budget ε = 6" in shown
    assert "remaining ε" in shown
    assert "dp-sgd" in shown


def test_a_plan_that_would_spend_the_budget_in_one_go_is_refused_also_after_a_restart(tmp_path):
    """The attack: the aggregator's plan sets a tiny σ, so one round of DP-SGD would cost more than the
    silo's whole budget. The silo's ledger refuses before training, records nothing, and a restarted silo
    (a new ledger on the same file) refuses again."""
    greedy = DPSettings(enabled=True, epsilon=100.0, noise_multiplier=0.05)
    method = METHODS["fedavg"](
        options=METHODS["fedavg"].Options(), train=PLAN.train, model=_spec(), rounds=3, dp=greedy
    )
    path = tmp_path / PRIVACY_LEDGER
    for _ in range(2):  # before and after a restart
        ledger = PrivacyLedger(Budget(2.0, 1e-5), path)
        silo = SiloPrivacy(greedy, method=method, ledger=ledger, rng=SecureRandom.seeded(0))
        with pytest.raises(BudgetExceeded, match="budget of ε = 2"):
            silo.admit_sgd(sample_rate=0.5, steps=20)
        assert ledger.entries == []
    honest = SiloPrivacy(
        replace(greedy, noise_multiplier=8.0), method=method, ledger=PrivacyLedger(Budget(2.0, 1e-5), path)
    )
    assert honest.admit_sgd(sample_rate=0.5, steps=20) == 8.0  # a plan within budget still trains


def test_the_operator_sees_a_silos_remaining_budget_only_if_it_reports_it():
    lock = threading.Condition()
    sessions = Sessions(lock)
    with lock:  # `open` is called with the engine's lock held
        sessions.open("silo-0")
        sessions.open("silo-1")
    sessions.heartbeat("silo-0", "training", 3.25)
    sessions.heartbeat("silo-1", "training")
    described = {s: sessions.describe(s, 0) for s in ("silo-0", "silo-1")}
    assert described["silo-0"]["privacy_remaining"] == 3.25
    assert "privacy_remaining" not in described["silo-1"]
    status = operator_pb2.StatusResponse(
        silos=[operator_pb2.SiloStatus(silo_id=s, **described[s]) for s in ("silo-0", "silo-1")]
    )
    rows = {
        line.split()[0]: line.split()[-1] for line in render(status).splitlines() if line.startswith("silo-")
    }
    assert rows == {"silo-0": "3.25", "silo-1": "-"}


def test_a_silo_that_requires_dp_refuses_a_plan_without_it():
    """A silo whose `[dp] require = true` must not train under a plan that switched DP off; by default it
    accepts both, and its ledger still guards every private plan."""
    strict, lenient = DPSection(require=True), DPSection()
    assert strict.problems(DPSettings(enabled=False)) == [
        "its plan does not enable [dp], which this silo's dp.require asks for"
    ]
    assert strict.problems(DPSettings(enabled=True)) == []
    assert lenient.problems(DPSettings(enabled=False)) == []


def _spec() -> ModelSpec:
    return ModelSpec(PLAN.model.name, tuple(PLAN.model.image_shape), len(PLAN.model.classes))
