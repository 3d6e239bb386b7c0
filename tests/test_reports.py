"""The side-by-side report of two runs that `make demo` prints after its two consortia."""

import pytest

from aggregator.demo import DemoError, run_demo
from fedlt.reports import comparison_table, plot_comparison

RULES = {"many": "> 100", "medium": "20..100", "few": "< 20"}


def _final(per_class, accuracy, many, medium, few):
    return {"per_class": per_class, "accuracy": accuracy, "many": many, "medium": medium, "few": few}


def test_two_runs_side_by_side_with_the_seconds_gain_in_points(tmp_path):
    finals = {
        "fedavg": _final([1.0, 0.5, 0.1], 0.533, 1.0, 0.5, 0.1),
        "balanced": _final([0.98, 0.7, 0.45], 0.71, 0.98, 0.7, 0.45),
    }
    table = comparison_table(finals, ["a", "b", "c"], [300, 50, 5], RULES).splitlines()
    assert table[0].split() == ["train", "n", "fedavg", "balanced", "gain"]
    assert table[1].split() == ["overall", "53.3%", "71.0%", "+17.7"]
    assert table[4].split()[:4] == ["few", "10.0%", "45.0%", "+35.0"]
    assert table[-1].split() == ["c", "5", "10.0%", "45.0%", "+35.0"]
    assert table[-3].split() == ["a", "300", "100.0%", "98.0%", "-2.0"]
    plot_comparison(finals, ["a", "b", "c"], [300, 50, 5], tmp_path / "c.png", "two runs")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_missing_group_has_no_gain():
    finals = {"x": _final([0.5], 0.5, 0.5, None, None), "y": _final([0.6], 0.6, 0.6, None, None)}
    table = comparison_table(finals, ["a"], [150], RULES).splitlines()
    assert table[3].split()[:3] == ["medium", "n/a", "n/a"]
    assert "+" not in table[3]


def test_the_demo_refuses_a_method_it_does_not_know_before_touching_its_folder(tmp_path):
    (tmp_path / "keep").mkdir()
    with pytest.raises(DemoError, match="unknown methods \\['fedsgd'\\]"):
        run_demo(tmp_path / "keep", silos=2, rounds=1, methods=["fedavg", "fedsgd"])
    assert (tmp_path / "keep").exists()


@pytest.mark.slow
def test_the_demo_runs_both_methods_on_the_same_silos_and_prints_them_side_by_side(tmp_path, capsys):
    assert run_demo(tmp_path / "demo", silos=3, rounds=2, methods=["fedavg", "balanced"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("the same silos, fedavg against balanced") :].splitlines()
    assert table[1].split() == ["train", "n", "fedavg", "balanced", "gain"]
    assert table[2].split()[0] == "overall"
    assert [line.split()[0] for line in table[7:17]] == [str(c) for c in range(10)]
    assert (tmp_path / "demo" / "comparison.png").stat().st_size > 0
    assert (tmp_path / "demo" / "balanced" / "aggregator-data" / "run" / "metrics.json").exists()
