"""Issue 31's smaller mends, each as the walkthrough met it: the status ε column in a study without DP, DP
announced at both ends, and plots that exist while the run does."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import replace

import pytest

from aggregator.config import load_consortium_config
from aggregator.evaluation import Evaluator
from aggregator.server import serve
from aggregator.status import render as render_status
from aggregator.store import Store
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.dp import DPSettings
from fedlt.metrics import ShotThresholds
from fedlt.recorder import RunRecorder
from fedlt.v1 import operator_pb2
from silo.admission import PlanCache
from silo.agent import SiloAgent
from silo.config import load_silo_config
from tests.consortium_harness import AUDIT_KEY, PLAN, write_kit


@pytest.mark.parametrize("dp", [False, True])
def test_the_terminal_status_shows_epsilon_left_only_under_dp(dp):
    """Without [dp] the ε a silo reports is its lifetime budget: the walkthrough's operator read 8.0 as
    what the study had left."""
    status = operator_pb2.StatusResponse(
        silos=[
            operator_pb2.SiloStatus(silo_id="silo-0", privacy_remaining=8.0),
            operator_pb2.SiloStatus(silo_id="silo-1"),
        ]
    )
    lines = render_status(status, dp=dp).splitlines()
    left = {line.split()[0]: line[-8:].strip() for line in lines if line.startswith("silo-")}  # ε: 8 wide
    assert left == ({"silo-0": "8", "silo-1": "-"} if dp else {"silo-0": "no DP", "silo-1": "no DP"})


def test_the_plots_are_drawn_after_each_recorded_round_not_only_at_shutdown(tmp_path):
    """The walkthrough's operator found no accuracy.png during a run (it was drawn at shutdown only, and
    never for a run that was killed)."""
    _, test = split_balanced_test(load_embedded("digits"), per_class=3, seed=0)
    recorder = RunRecorder(
        tmp_path / "run", title="t", test=test, train_counts=None, thresholds=ShotThresholds(), header={}
    )
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    evaluator = Evaluator(
        recorder=recorder,
        method=PLAN.build_method(),
        store=store,
        background=False,
        echo=lambda line: None,
        total_rounds=lambda: 2,
    )
    plots = [tmp_path / "run" / name for name in ("accuracy.png", "per_class.png")]
    drawn = []
    for round_number in (1, 2):
        evaluator.counted(round_number, [1] * 10, [3] * 10, ["a", "b"], 1.0)
        evaluator._pool.submit(lambda: None).result()  # the evaluation thread has drawn what it was given
        drawn.append([(p.stat().st_ino, p.stat().st_mtime_ns) for p in plots])
    evaluator.shutdown()
    store.close()
    assert drawn[0] != drawn[1]  # redrawn for round 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "accuracy.png",
        "metrics.json",
        "per_class.png",
    ]  # no part-drawn file left beside them


@pytest.mark.parametrize("dp", [DPSettings(enabled=True, epsilon=6.0), DPSettings()], ids=["dp", "no-dp"])
def test_the_aggregator_says_at_start_whether_dp_is_on_and_how(tmp_path, dp):
    """The walkthrough's operator could not tell from either side's output that DP was on, or its σ."""
    write_kit(tmp_path, silos=2, plan=replace(PLAN, dp=dp))
    config = load_consortium_config(tmp_path / "consortium.toml")
    stop, said = threading.Event(), queue.Queue()
    serving = threading.Thread(target=serve, args=(config,), kwargs={"stop": stop, "echo": said.put})
    serving.start()
    try:
        while not said.get(timeout=120).startswith("privacy layer:"):
            pass
    finally:
        stop.set()
        serving.join()
    lines = list(said.queue)
    (line,) = [line for line in lines if line.startswith("differential privacy:")]
    if dp.enabled:
        assert "on, ε 6 at δ 1e-05 per silo over the plan" in line
        assert "DP-SGD σ chosen by each silo" in line
        assert "statistics noise multiplier the smallest within ε/2" in line
    else:
        assert line.startswith("differential privacy: off")


def test_a_silo_logs_its_dp_once_per_plan_and_the_sigma_it_chose_once_known(tmp_path, caplog):
    configs = write_kit(tmp_path, silos=3)
    agent = SiloAgent(load_silo_config(configs[0]))
    plan = replace(PLAN, dp=DPSettings(enabled=True, epsilon=6.0))
    digest = plan.sha256()
    caplog.set_level(logging.INFO, logger="silo")
    privacy = agent.plans.privacy(plan, digest)
    agent.plans.privacy(plan, digest)  # the same plan's next round
    (built,) = [r.getMessage() for r in caplog.records if "differential privacy on" in r.getMessage()]
    assert built.startswith(f"plan {digest[:16]}…: differential privacy on: ε 6 at δ 1e-05 for the plan")
    assert "DP-SGD σ chosen at its first training" in built
    assert f"statistics noise multiplier {privacy.statistics_noise:.4g}" in built
    assert "ε left in this silo's budget" in built

    caplog.clear()
    for _ in range(2):  # two rounds' training: σ is announced after the first only
        sigma = privacy.admit_sgd(sample_rate=0.1, steps=10)
        agent.plans.announce_sigma(plan, digest)
    (announced,) = [r.getMessage() for r in caplog.records if "DP-SGD σ" in r.getMessage()]
    assert f"DP-SGD σ {sigma:.4g}, the smallest that keeps the plan within ε 6" in announced

    caplog.clear()
    PlanCache(agent.privacy_ledger).privacy(plan, digest)  # as after a restart: σ is known from the ledger
    assert f"DP-SGD σ {round(sigma, 4):.4g}, clipping" in caplog.text
