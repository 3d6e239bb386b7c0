import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedlt.config import _toml_value, as_toml, read_toml
from fedlt.errors import ConfigError
from fedlt.methods.fedprox import FedProxOptions
from fedlt.plan import ModelSection, RoundPlan
from fedlt.sim.config import SimConfig, load_sim_config


def _write(tmp_path, text):
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    config = load_sim_config(None, {})
    assert config == SimConfig()
    assert config.method.name == "fedavg"


def test_every_problem_is_reported_at_once(tmp_path):
    path = _write(
        tmp_path,
        """
rounds = 0
sede = 1
[data]
alpha = -1
silos = true
dataset = "imagenet"
[train]
lr = "fast"
""",
    )
    with pytest.raises(ConfigError) as err:
        load_sim_config(path, {})
    problems = err.value.problems
    assert "rounds: must be >= 1, got 0" in problems
    assert any(p.startswith("sede: unknown setting (did you mean 'seed'?)") for p in problems)
    assert "data.alpha: must be > 0.0, got -1.0" in problems
    assert "data.silos: expected int, got a boolean True" in problems
    assert any(p.startswith("data.dataset: must be one of 'mnist5k', 'digits'") for p in problems)
    assert "train.lr: expected float, got a string 'fast'" in problems
    assert str(tmp_path / "sim.toml") in str(err.value)


def test_method_options_are_checked_against_the_chosen_method(tmp_path):
    config = load_sim_config(_write(tmp_path, '[method]\nname = "fedprox"\nmu = 0.5\n'), {})
    assert config.method.options == FedProxOptions(mu=0.5)
    with pytest.raises(ConfigError, match=r"method.mu: unknown setting"):
        load_sim_config(_write(tmp_path, '[method]\nname = "fedavg"\nmu = 0.5\n'), {})
    with pytest.raises(ConfigError, match="unknown method 'fedsgd'; allowed: fedavg, fedprox"):
        load_sim_config(None, {"method": "fedsgd"})


def test_flags_override_the_file(tmp_path):
    path = _write(tmp_path, "rounds = 5\n[data]\nalpha = 0.1\nsilos = 3\n")
    config = load_sim_config(path, {"rounds": 7, "alpha": None, "local_epochs": 3, "dataset": "digits"})
    assert config.rounds == 7
    assert config.data.alpha == 0.1
    assert config.data.silos == 3
    assert config.data.dataset == "digits"
    assert config.train.local_epochs == 3


def test_written_config_reads_back_identically(tmp_path):
    config = load_sim_config(None, {"method": "fedprox", "rounds": 3, "dataset": "digits"})
    path = tmp_path / "round_trip.toml"
    path.write_text(as_toml(config))
    assert load_sim_config(str(path), {}) == config


def test_file_problems_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_sim_config(_write(tmp_path, "rounds = = 3"), {})
    with pytest.raises(ConfigError, match="data: expected a table, got an integer"):
        load_sim_config(_write(tmp_path, "data = 3"), {})


def test_fingerprint_ignores_rounds_only():
    a = load_sim_config(None, {"rounds": 3})
    assert a.fingerprint() == load_sim_config(None, {"rounds": 9}).fingerprint()
    assert a.fingerprint() != load_sim_config(None, {"rounds": 3, "seed": 1}).fingerprint()


def test_the_operator_guides_consortium_toml_loads(tmp_path):
    """Guards the documentation: every setting the guide shows exists and is valid."""
    import re
    from pathlib import Path

    from aggregator.config import load_consortium_config

    guide = (Path(__file__).parent.parent / "docs" / "operator.md").read_text()
    (example,) = [b for b in re.findall(r"```toml\n(.*?)```", guide, re.S) if "[consortium]" in b]
    path = tmp_path / "consortium.toml"
    path.write_text(example)
    config = load_consortium_config(path)
    assert config.server.status_page == "127.0.0.1:8080"
    assert (config.retention.last, config.retention.every) == (3, 10)


@given(st.text())
def test_any_text_setting_round_trips_through_the_toml_written(text):
    """Found in review: only backslash and quote were escaped, so a class name with a newline (an aggregator's
    plan may carry one) broke out of its string in a plan's TOML and in a model card."""
    written = "value = " + _toml_value(text)
    assert tomllib.loads(written)["value"] == text
    assert "\n" not in written


def test_a_plan_with_class_names_that_are_not_printable_is_refused():
    plan = RoundPlan(model=ModelSection(classes=("normal", "x\n## Attestations")))
    with pytest.raises(ConfigError, match="not printable names"):
        RoundPlan.from_toml(plan.to_toml(), "a hostile plan")
