import json
import subprocess
import sys

import pytest

from fedlt.recorder import round_line
from fedlt.sim.__main__ import main
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import RunFolderError, run_simulation

FAST = {"dataset": "digits", "silos": 4, "rounds": 2, "imbalance": 10.0, "alpha": 0.5}


def _config(**overrides):
    return load_sim_config(None, {**FAST, **overrides})


def _quiet(_line):
    pass


def test_same_seed_same_metrics(tmp_path):
    a = run_simulation(_config(), tmp_path / "a", echo=_quiet)
    b = run_simulation(_config(), tmp_path / "b", echo=_quiet)
    c = run_simulation(_config(seed=1), tmp_path / "c", echo=_quiet)
    strip = lambda m: [{k: v for k, v in r.items() if "seconds" not in k} for r in m["rounds"]]  # noqa: E731
    assert strip(a.metrics) == strip(b.metrics)
    assert a.state.digest() == b.state.digest()
    assert a.state.digest() != c.state.digest()


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    whole = run_simulation(_config(rounds=3), tmp_path / "whole", echo=_quiet)
    run_simulation(_config(rounds=1), tmp_path / "parts", echo=_quiet)
    lines = []
    resumed = run_simulation(_config(rounds=3), tmp_path / "parts", echo=lines.append)
    assert lines[0].startswith("resuming")
    assert len(lines) == 3  # the resume notice and rounds 2 and 3 only
    assert resumed.state.digest() == whole.state.digest()
    assert [r["round"] for r in resumed.metrics["rounds"]] == [1, 2, 3]


def test_folder_of_another_run_is_refused(tmp_path):
    run_simulation(_config(rounds=1), tmp_path, echo=_quiet)
    with pytest.raises(RunFolderError, match="different settings"):
        run_simulation(_config(rounds=1, seed=5), tmp_path, echo=_quiet)


def test_folder_with_more_rounds_than_asked_is_refused(tmp_path):
    run_simulation(_config(rounds=2), tmp_path, echo=_quiet)
    with pytest.raises(RunFolderError, match="already holds 2 training rounds, more than the 1 asked for"):
        run_simulation(_config(rounds=1), tmp_path, echo=_quiet)


def test_run_folder_contents(tmp_path):
    result = run_simulation(_config(), tmp_path, echo=_quiet)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["final"]["round"] == 2
    assert len(metrics["rounds"]) == 2
    assert metrics["shot_groups"]["many"]["rule"] == "> 100 training samples"
    groups = [c for g in ("many", "medium", "few") for c in metrics["shot_groups"][g]["classes"]]
    assert sorted(groups) == list(range(10))
    assert len(metrics["final"]["per_class"]) == 10
    assert sum(metrics["dataset"]["silo_sizes"]) == sum(metrics["dataset"]["train_counts"])
    for png in ("accuracy.png", "per_class.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_sim_config(str(tmp_path / "config.toml"), {}) == _config()
    assert "few" in result.table


def test_cli_runs_and_prints_the_table(tmp_path, capsys):
    flags = ["--dataset", "digits", "--silos", "3", "--rounds", "1", "--imbalance", "10", "--quiet"]
    assert main([*flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy after round 1" in out
    assert "overall" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "fedsgd"], "unknown method 'fedsgd'"),
        (["--alpha", "0"], "data.alpha: must be > 0.0"),
        (["--config", "/nonexistent/sim.toml"], "no such file"),
        (["--dataset", "digits", "--model", "cnn"], "cnn takes 28x28 images, got 8x8"),
    ],
)
def test_cli_user_errors_are_one_clear_line(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "fedlt.sim", *args, "--out", str(tmp_path / "run"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_round_line_with_and_without_a_duration():
    entry = {"round": 3, "accuracy": 0.5, "many": 0.9, "medium": None, "few": 0.0, "seconds": 1.25}
    assert (
        round_line(entry, 10) == "round    3/10  acc  50.0%  many  90.0%  medium    n/a  few   0.0%  (1.2 s)"
    )
    assert round_line({**entry, "seconds": None}, 10).endswith("few   0.0%")
