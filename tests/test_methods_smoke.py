"""Every method of the table runs end to end in the simulator, at the demo's setting, for a few rounds."""

import math
from dataclasses import replace

import pytest

from fedlt.methods import METHODS
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import run_simulation

DEMO_SETTING = {"dataset": "mnist5k", "imbalance": 100.0, "alpha": 0.5, "silos": 10, "rounds": 2}
# SFD's closing round at its defaults (D = 3000, 100 synthesis steps per class) takes about a minute here
QUICK = {"sfd": {"rff_features": 200, "synthesis_steps": 5, "finetune_epochs": 5}}
# rounds besides training: post-hoc heads are fitted in a closing round, the balanced recipe sums priors first
EXTRA_ROUNDS = {"ccvr": 1, "sfd": 1, "dflfs": 1, "balanced": 1}


# the three slowest here (20-25 s each) in `make test-all`; their own test modules run in every run
SLOW_HERE = {"creff", "dflfs", "sfd"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_HERE else n for n in sorted(METHODS)]
)
def test_method_runs_in_the_simulator(tmp_path, name):
    method = {"name": name, **QUICK.get(name, {})}
    config = load_sim_config("configs/demo.toml", DEMO_SETTING, method=method)
    result = run_simulation(config, tmp_path / name, echo=lambda _: None)
    rounds = result.metrics["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    assert len(rounds) == 2 + EXTRA_ROUNDS.get(name, 0)
    assert all(math.isfinite(r["accuracy"]) for r in rounds)
    assert rounds[-1]["accuracy"] > 0.15  # better than chance (10 classes) after two rounds
    assert (tmp_path / name / "accuracy.png").exists()


def test_per_class_fields_go_through_the_secure_layer_and_its_tail_guard(tmp_path):
    """CReFF over secagg: the census runs on its per-class fields and the run completes."""
    config = load_sim_config(
        None,
        {
            "dataset": "digits",
            "silos": 4,
            "rounds": 2,
            "imbalance": 10.0,
            "method": "creff",
            "privacy": "secagg",
        },
    )
    plain = run_simulation(replace(config, privacy="plaintext"), tmp_path / "p", echo=lambda _: None)
    secure = run_simulation(config, tmp_path / "s", echo=lambda _: None)
    assert abs(secure.metrics["rounds"][-1]["accuracy"] - plain.metrics["rounds"][-1]["accuracy"]) < 0.05


def test_a_finished_post_hoc_run_extends_with_more_training_then_calibrates_again(tmp_path):
    flags = {"dataset": "digits", "silos": 4, "imbalance": 10.0, "method": "ccvr"}
    first = run_simulation(
        load_sim_config(None, {**flags, "rounds": 2}), tmp_path / "run", echo=lambda _: None
    )
    assert first.state.round == 3
    assert "head.weight" in first.state.extra
    longer = run_simulation(
        load_sim_config(None, {**flags, "rounds": 3}), tmp_path / "run", echo=lambda _: None
    )
    assert longer.state.round == 5
    assert "head.weight" in longer.state.extra
    assert [r["round"] for r in longer.metrics["rounds"]] == [1, 2, 3, 4, 5]
