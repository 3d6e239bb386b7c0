"""Secure aggregation at scale (issue 37): Shamir's cached Lagrange basis, the aggregator unmasking in place,
and benchmarks/secagg.py's growth fits and its Flower comparison's plumbing."""

from __future__ import annotations

import itertools
import json
import math
import secrets
import stat
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.ring import Ring
from privacy.secagg import shamir
from privacy.secagg.local import run_session
from privacy.secagg.protocol import SessionSpec
from tests.test_benchmarks_load import bench as bench  # the module-scoped fixture: the script, loaded

# --- Shamir: one basis per set of holders' places -------------------------------------------------------


@given(xs=st.sets(st.integers(1, 10**6), min_size=1, max_size=12), at=st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_the_basis_reproduces_every_polynomial_below_its_degree(xs, at):
    """Σ_i L_i(at) · x_i^k = at^k for k < len(xs): the defining property of Lagrange's basis, checked
    without the formula the code uses."""
    xs = tuple(sorted(xs))
    basis = shamir._basis(xs, at)
    for k in range(len(xs)):
        assert sum(w * pow(x, k, shamir.PRIME) for w, x in zip(basis, xs, strict=True)) % shamir.PRIME == pow(
            at, k, shamir.PRIME
        )


@given(holders=st.integers(2, 12), data=st.data())
@settings(max_examples=30, deadline=None)
def test_many_secrets_over_the_same_and_other_places_all_rebuild(holders, data):
    """As an aggregator rebuilds them: many seeds from the same holders' places (the cached basis), then
    from another set of places (a holder gone)."""
    threshold = data.draw(st.integers(1, holders))
    secrets_ = [secrets.token_bytes(shamir.SECRET_BYTES) for _ in range(4)]
    parts = [shamir.split(s, shares=holders, threshold=threshold) for s in secrets_]
    places = [data.draw(st.sets(st.integers(1, holders), min_size=threshold)) for _ in range(3)]
    for subset in places:
        for secret, shares in zip(secrets_, parts, strict=True):
            assert shamir.combine({x: shares[x] for x in subset}, threshold=threshold) == secret


def test_a_share_tampered_beyond_the_threshold_is_caught_once_the_basis_is_cached():
    """The check of the shares beyond the threshold runs for every secret, not only the first of a set of
    places: one honest rebuild first, then the same places with the last share altered by one."""
    honest = shamir.split(secrets.token_bytes(32), shares=7, threshold=5)
    shamir.combine(honest, threshold=5)
    victim = shamir.split(secrets.token_bytes(32), shares=7, threshold=5)
    victim[7] = (victim[7] + 1) % shamir.PRIME  # the first five alone still rebuild the secret
    with pytest.raises(shamir.ShamirError, match="inconsistent or tampered"):
        shamir.combine(victim, threshold=5)


def test_the_basis_is_computed_once_for_a_session_of_many_seeds():
    shamir._basis.cache_clear()
    for _ in range(30):
        secret = secrets.token_bytes(32)
        assert shamir.combine(shamir.split(secret, shares=30, threshold=21), threshold=21) == secret
    info = shamir._basis.cache_info()
    assert info.misses == 1 + 9  # at 0, and at each of the 9 places checked beyond the threshold
    assert info.hits == 29 * 10


# --- the aggregator's unmasking -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("neighbours", "dropouts"),
    [(0, {}), (4, {}), (4, {"s07": "consistency"}), (4, {"s07": "masked"}), (0, {"s00": "masked"})],
)
def test_the_sum_over_a_sparse_or_complete_graph_with_a_dropout_is_exact(neighbours, dropouts):
    """The masks come off the aggregator's running total in place: its sum is still the survivors' sum to
    the bit, with the seeds rebuilt over varying holders' places (a holder gone shifts them)."""
    ids = tuple(f"s{k:02d}" for k in range(9))
    ring = Ring(3, 40)
    spec = SessionSpec("r1", "contribution", ids, ring, neighbours=neighbours)
    rng = np.random.default_rng(7)
    inputs = {u: ring.random(rng) for u in ids}
    total, survivors = run_session(spec, {u: v.copy() for u, v in inputs.items()}, dropouts=dropouts)
    expected = ring.zeros()
    for u in survivors:
        ring.add(expected, inputs[u])
    assert survivors == tuple(u for u in ids if dropouts.get(u) != "masked")
    assert np.array_equal(total, expected)


def test_a_census_recomputed_by_every_silo_matches_the_aggregators_after_in_place_unmasking():
    """In a sum silos recompute, each silo unmasks its own total from the transcript; `run_session` raises
    if any silo's differs from the aggregator's."""
    ids = tuple(f"s{k}" for k in range(5))
    ring = Ring(0, 16)
    spec = SessionSpec("r1", "census", ids, ring)
    inputs = {u: ring.random(np.random.default_rng(k)) for k, u in enumerate(ids)}
    total, _ = run_session(spec, inputs, dropouts={"s4": "consistency"})
    expected = ring.zeros()
    for u in ids:
        ring.add(expected, inputs[u])
    assert np.array_equal(total, expected)


# --- benchmarks/secagg.py: growth fits and the rows it runs -------------------------------------------------

SILOS = (10, 30, 100, 300)


@pytest.mark.parametrize("law", ["log n", "n", "n log n", "n^2"])
def test_the_fit_names_the_law_noisy_costs_grew_by(bench, law):
    noise = np.random.default_rng(0).uniform(-0.02, 0.02, len(SILOS))
    costs = [(0.005 + 0.001 * bench.LAWS[law](n)) * (1 + e) for n, e in zip(SILOS, noise, strict=True)]
    fit = bench.fit_growth(SILOS, costs)
    assert fit["best"] == law
    assert fit["laws"][law]["b"] == pytest.approx(0.001, rel=0.1)


def test_the_loglog_slope_is_the_exponent_of_a_power_law(bench):
    for exponent in (0.5, 1.0, 2.0):
        fit = bench.fit_growth(SILOS, [3e-4 * n**exponent for n in SILOS])
        assert fit["loglog_slope"] == pytest.approx(exponent, abs=1e-9)


def test_a_cost_that_shrinks_with_n_has_no_growth_law(bench):
    assert bench.fit_growth(SILOS, [1 / n for n in SILOS])["best"] is None


def row(n: int, graph: str, unmask_after: float | None) -> dict:
    return {
        "silos": n,
        "graph": graph,
        "masking_s_median": 0.001 * math.log(n),
        "masking_all_silos_s_median": 0.001 * n * math.log(n),
        "unmask_s_median": {"none": 0.001 * n, "after_masked": unmask_after, "before_masked": None},
        "bytes_per_silo": {"up_total": 5000 + n, "down_total": 100 * n, "up": {"Submit (masked)": 5000}},
    }


def test_growth_fits_each_cost_measured_at_three_silo_counts_or_more(bench):
    fits = bench.growth([row(300, "secagg+", 0.2), row(10, "secagg+", None), row(30, "secagg+", 0.02)])
    assert fits["masking_s"]["silos"] == [10, 30, 300]  # sorted by n
    assert fits["masking_s"]["best"] == "log n"
    assert fits["masking_all_silos_s"]["best"] == "n log n"
    assert fits["unmask_s_none"]["best"] == "n"
    assert "unmask_s_after_masked" not in fits  # two points: none at n = 10
    assert "unmask_s_before_masked" not in fits
    assert fits["protocol_bytes"]["values"] == [
        10 + 1000,
        30 + 3000,
        300 + 30000,
    ]  # the masked vector left out


def test_rows_beyond_what_the_machine_affords_are_skipped_with_their_reason(bench):
    assert bench.skip_reason(30, "full", 30) == ""
    assert "complete graph beyond 30 silos" in bench.skip_reason(100, "full", 30)
    assert bench.skip_reason(100, "full", 100) == ""
    assert "degree reaches n − 1" in bench.skip_reason(3, "secagg+", 30)
    assert bench.skip_reason(300, "secagg+", 30) == ""


def test_session_takes_one_repeat_count_or_one_per_silo_count(bench):
    with pytest.raises(ValueError, match="one per n"):
        bench.session([10, 30, 100], [3, 1], "cnn-small")


# --- the Flower comparison's plumbing (Flower itself runs in a venv of its own) ---------------------------


def test_flower_gets_our_threshold_unless_its_workflow_refuses_it(bench):
    assert bench.flower_threshold(11, 8) == 8  # SecAgg+ at n = 30: k + 1 = 11 holders, t = 8
    assert bench.flower_threshold(3, 3) == 2  # n = 3: Flower refuses t = num_shares


def test_flower_runs_with_our_holders_threshold_and_cases(bench, tmp_path):
    """A stand-in interpreter records the arguments the benchmark passes to flower_secaggplus.py and answers
    as the script does; the benchmark reads one repeat back."""
    argv_file = tmp_path / "argv.json"
    answer = {"flwr": "x", "masked_input_s": [0.5], "unmask_s": {"none": [2.0], "after_masked": [3.0]}}
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[2:]))\n"
        f"print(json.dumps({answer!r}))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    flower = bench.Flower(str(fake), [[3, 4], [5]])
    out = bench.flower_run(flower, 30, 11, 8, ["none", "after_masked"])
    assert out == {"masked_input_s": 0.5, "unmask_s": {"none": 2.0, "after_masked": 3.0}}
    args = json.loads(argv_file.read_text())
    pairs = dict(itertools.pairwise(args))
    assert (pairs["--silos"], pairs["--shares"], pairs["--threshold"]) == ("30", "11", "8")
    assert json.loads(pairs["--shapes"]) == [[3, 4], [5]]
    assert args[args.index("--cases") + 1 :] == ["none", "after_masked"]


def test_flower_ratios_are_per_repeat_then_the_median(bench):
    runs = [
        {"masked_input_s": 1.0, "unmask_s": {"none": 10.0}},
        {"masked_input_s": 4.0, "unmask_s": {"none": 30.0}},
        {"masked_input_s": 9.0, "unmask_s": {"none": 90.0}},
    ]
    against = bench.against_flower(runs, [0.1, 1.0, 0.3], {"none": [1.0, 1.0, 0.5]}, 11, 8)
    assert against["ratio_flower_over_ours"] == 10.0  # 10, 4, 30
    assert against["ratio_unmask_flower_over_ours"] == {"none": 30.0}  # 10, 30, 180
    assert against["unmask_s_median"] == {"none": 30.0}
    assert (against["num_shares"], against["threshold"]) == (11, 8)
