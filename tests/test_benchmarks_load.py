"""The load benchmark's choices that decide what it measures: SecAgg+'s degree, and silos that accept it."""

from __future__ import annotations

import importlib.util
import math
import sys
import tomllib
from pathlib import Path

import pytest

from privacy.secagg.settings import SecAggSettings
from silo.config import load_silo_config
from tests.consortium_harness import write_kit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """benchmarks/secagg.py (benchmarks/ is no package, and the venv has an unrelated `benchmarks`)."""
    spec = importlib.util.spec_from_file_location("secagg_benchmark", BENCHMARKS / "secagg.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_secagg_plus_degree_golden_values(bench):
    assert [bench.secagg_plus_degree(n) for n in (2, 3, 4, 10, 30, 100, 1000)] == [0, 0, 0, 8, 10, 14, 20]


def test_secagg_plus_degree_is_even_and_sparse_or_else_the_complete_graph(bench):
    for n in range(2, 300):
        k = bench.secagg_plus_degree(n)
        shape = SecAggSettings(neighbours=k).session(
            "r1.a1.x", "contribution", [f"s{i:03}" for i in range(n)], 1, b""
        )
        if k:
            assert k % 2 == 0
            assert k >= 2 * math.log2(n)
            assert not shape.complete
            assert shape.holder_count == k + 1 < n
        else:
            assert shape.complete, n


def test_graph_names_are_checked(bench):
    assert bench.neighbours_for("full", 30) == 0
    assert bench.neighbours_for("secagg+", 30) == 10
    with pytest.raises(ValueError, match="allowed: full, secagg\\+"):
        bench.neighbours_for("sparse", 30)


def test_silos_of_the_benchmark_accept_the_degree_asked(bench, tmp_path):
    configs = write_kit(tmp_path, silos=3)
    bench.add_to_policy(configs[0], {"min_neighbours": 10})
    assert tomllib.loads(configs[0].read_text())["policy"]["min_neighbours"] == 10
    assert load_silo_config(configs[0]).policy.min_neighbours == 10
    assert load_silo_config(configs[1]).policy.min_neighbours == 0  # untouched: the complete graph only
