"""What the census and per-class sums let an aggregator (and one malicious silo) learn about who holds what.

Presence intersection: which classes a silo holds does not change between rounds, so sums of presence over
changing silo sets (partial participation: 10 silos, 5 a round) form a linear system in each silo's presence
bits. The attack is solved here against what a per-round census released, where it recovers every silo's
holdings, and against what the `secagg` layer releases now, where it cannot.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedlt.aggregation import Field, Schema, tail_guard
from fedlt.aggregation.tail_guard import CensusError
from privacy.secagg.layer import SecAggSum
from privacy.secagg.local import run_session
from privacy.secagg.protocol import SessionSpec

CLASSES, SILOS, PER_ROUND, ROUNDS = 6, 10, 5, 15
SCHEMA = Schema(
    (
        Field("delta", (4,), 10.0, frac_bits=16),
        Field("grad", (CLASSES, 3), 10.0, frac_bits=16, per_class=True),
        Field("present", (CLASSES,), 1.0, frac_bits=0, per_class=True),
    )
)
NAMES = [f"silo-{k}" for k in range(SILOS)]


def holdings(seed: int = 3) -> np.ndarray:
    """[silos, classes] presence: the head class everywhere, the rest long-tailed."""
    rng = np.random.default_rng(seed)
    p = np.linspace(1.0, 0.2, CLASSES)
    return (rng.random((SILOS, CLASSES)) < p).astype(np.int64)


def contribution(present: np.ndarray, round_number: int, silo: int):
    rng = np.random.default_rng(1000 * round_number + silo)
    grad = torch.from_numpy(rng.normal(size=(CLASSES, 3)) * present[:, None])
    return SCHEMA.contribution(
        delta=torch.from_numpy(rng.normal(size=4)), grad=grad, present=torch.from_numpy(present.astype(float))
    )


def schedule() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [sorted(rng.choice(SILOS, PER_ROUND, replace=False).tolist()) for _ in range(ROUNDS)]


def solve(rows: list[list[int]], sums: list[np.ndarray]) -> np.ndarray | None:
    """The aggregator's least-squares solution for every silo's presence, if the system determines it."""
    a = np.zeros((len(rows), SILOS))
    for i, picked in enumerate(rows):
        a[i, picked] = 1
    if np.linalg.matrix_rank(a) < SILOS:
        return None
    solution, *_ = np.linalg.lstsq(a, np.stack(sums), rcond=None)
    return np.rint(solution).astype(np.int64)


def test_presence_summed_over_changing_silo_sets_reveals_every_silos_classes():
    """The attack first, against a census per round: it recovers every silo's holdings exactly."""
    truth, rounds = holdings(), schedule()
    released = [truth[picked].sum(axis=0) for picked in rounds]  # what a census per round gave the aggregator
    assert np.array_equal(solve(rounds, released), truth)


def test_the_secagg_layer_gives_the_intersection_nothing_to_solve():
    truth, rounds = holdings(), schedule()
    layer = SecAggSum()
    seen_rows, seen_sums = [], []
    for r, picked in enumerate(rounds, start=1):
        sums = layer.aggregate(
            SCHEMA, [contribution(truth[k], r, k) for k in picked], silos=[NAMES[k] for k in picked]
        )
        seen_rows.append(picked)
        seen_sums.append(np.rint(sums["present"].numpy()).astype(np.int64))
    (census,) = layer.censuses.values()
    assert census.silos == tuple(NAMES[k] for k in rounds[0])  # taken once, over the first round's silos
    # every later round is over another set: no per-class row of it was released, presence included
    assert all(not s.any() for s in seen_sums[1:])
    first = np.asarray(census.counts)
    assert np.array_equal(seen_sums[0], np.where(first >= 2, first, 0))  # the census round itself
    # all the aggregator holds is one sum per class over one set of five silos: nothing to solve
    assert solve(seen_rows[:1], [first]) is None


def test_two_censuses_of_one_phase_over_sets_that_differ_by_one_silo_would_give_it_away():
    """Why a silo signs one census per phase (tests/test_silo_releases.py shows it refusing the second)."""
    truth = holdings()
    ids = tuple(NAMES)
    present = {u: truth[k].astype(np.uint64) for k, u in enumerate(ids)}
    spec = SessionSpec("r1", "census", ids, CLASSES, threshold=SILOS)
    full, _ = run_session(spec, present)
    without = SessionSpec("r1.retry", "census", ids[1:], CLASSES, threshold=SILOS - 1)
    rest, _ = run_session(without, {u: present[u] for u in ids[1:]})
    assert np.array_equal(full - rest, truth[0])


def test_one_malicious_silo_can_lift_a_class_to_k_min_and_no_further_than_the_silos_counted():
    """The documented limit: census inputs are masked, so a silo can claim any count for itself; a silo can
    check only that its own classes are counted and that no count exceeds the silos counted."""
    ids = ("a", "b", "c", "mallory")
    honest = {"a": [1, 0, 1], "b": [1, 0, 0], "c": [1, 0, 0]}  # class 2: only a holds it
    inputs = {u: np.array(v, dtype=np.uint64) for u, v in honest.items()}
    inputs["mallory"] = np.array([1, 0, 1], dtype=np.uint64)  # k_min - 1 = 1 extra for class 2
    counts, counted = run_session(SessionSpec("r", "census", ids, 3), inputs)
    tail_guard.check_census(counts, inputs["a"], len(counted))  # a cannot tell
    census = tail_guard.Census.of(counted, counts)
    assert census.guarded(ids, k_min=2) == []  # class 2 passes the guard: a's row is summed with mallory's
    inputs["mallory"] = np.array([1, 0, 2**64 - 1], dtype=np.uint64)  # a wrapped count is caught
    counts, counted = run_session(SessionSpec("r", "census", ids, 3), inputs)
    with pytest.raises(CensusError, match="cannot be the sum"):
        tail_guard.check_census(counts, inputs["a"], len(counted))
    inputs["mallory"] = np.array([1, 0, 4], dtype=np.uint64)  # more holders than silos: caught
    counts, counted = run_session(SessionSpec("r", "census", ids, 3), inputs)
    with pytest.raises(CensusError, match="cannot be the sum"):
        tail_guard.check_census(counts, inputs["b"], len(counted))


@pytest.mark.parametrize("k_min", [2, 3])
def test_a_census_set_releases_exactly_the_classes_k_min_of_its_silos_hold(k_min):
    census = tail_guard.Census.of(["x", "y", "z"], [3, 2, 1, 0])
    expected = [c for c, n in enumerate([3, 2, 1, 0]) if 0 < n < k_min]
    assert census.guarded(["z", "y", "x"], k_min) == expected
    for other in itertools.chain(itertools.combinations("xyz", 2), [("x", "y", "z", "w")]):
        assert census.guarded(list(other), k_min) == [0, 1, 2, 3]
