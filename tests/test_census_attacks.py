"""What the census and per-class sums let an aggregator (and one malicious silo) learn about who holds what.

Presence intersection over changing silo sets (partial participation) is an attack of the audit
(`attacks.protocol.presence_intersection`, tested in tests/test_attacks_protocol.py against a census every
round, where it recovers every silo's holdings, and against the `secagg` layer, where it cannot). Here: why a
silo signs one census a phase, what one malicious silo can do to a census, and the guard's rule.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedlt.aggregation import tail_guard
from fedlt.aggregation.tail_guard import CensusError
from privacy.ring import Ring
from privacy.secagg.local import run_session
from privacy.secagg.protocol import SessionSpec

CLASSES, SILOS = 6, 10
NAMES = [f"silo-{k}" for k in range(SILOS)]


def holdings(seed: int = 3) -> np.ndarray:
    """[silos, classes] presence: the head class everywhere, the rest long-tailed."""
    rng = np.random.default_rng(seed)
    p = np.linspace(1.0, 0.2, CLASSES)
    return (rng.random((SILOS, CLASSES)) < p).astype(np.int64)


def summed(spec: SessionSpec, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, tuple[str, ...]]:
    """A secure sum of uint64 words (a ring of wide words only), as the protocol runs it."""
    total, counted = run_session(spec, {u: v.view(np.uint8) for u, v in inputs.items()})
    return total.view("<u8"), counted


def test_two_censuses_of_one_phase_over_sets_that_differ_by_one_silo_would_give_it_away():
    """Why a silo signs one census per phase (tests/test_silo_releases.py shows it refusing the second)."""
    truth = holdings()
    ids = tuple(NAMES)
    present = {u: truth[k].astype(np.uint64) for k, u in enumerate(ids)}
    spec = SessionSpec("r1", "census", ids, Ring(CLASSES), threshold=SILOS)
    full, _ = summed(spec, present)
    without = SessionSpec("r1.retry", "census", ids[1:], Ring(CLASSES), threshold=SILOS - 1)
    rest, _ = summed(without, {u: present[u] for u in ids[1:]})
    assert np.array_equal(full - rest, truth[0])


def test_one_malicious_silo_can_lift_a_class_to_k_min_and_no_further_than_the_silos_counted():
    """The documented limit: census inputs are masked, so a silo can claim any count for itself; a silo can
    check only that its own classes are counted and that no count exceeds the silos counted."""
    ids = ("a", "b", "c", "mallory")
    honest = {"a": [1, 0, 1], "b": [1, 0, 0], "c": [1, 0, 0]}  # class 2: only a holds it
    inputs = {u: np.array(v, dtype=np.uint64) for u, v in honest.items()}
    inputs["mallory"] = np.array([1, 0, 1], dtype=np.uint64)  # k_min - 1 = 1 extra for class 2
    counts, counted = summed(SessionSpec("r", "census", ids, Ring(3)), inputs)
    tail_guard.check_census(counts, inputs["a"], len(counted))  # a cannot tell
    census = tail_guard.Census.of(counted, counts)
    assert census.guarded(ids, k_min=2) == []  # class 2 passes the guard: a's row is summed with mallory's
    inputs["mallory"] = np.array([1, 0, 2**64 - 1], dtype=np.uint64)  # a wrapped count is caught
    counts, counted = summed(SessionSpec("r", "census", ids, Ring(3)), inputs)
    with pytest.raises(CensusError, match="cannot be the sum"):
        tail_guard.check_census(counts, inputs["a"], len(counted))
    inputs["mallory"] = np.array([1, 0, 4], dtype=np.uint64)  # more holders than silos: caught
    counts, counted = summed(SessionSpec("r", "census", ids, Ring(3)), inputs)
    with pytest.raises(CensusError, match="cannot be the sum"):
        tail_guard.check_census(counts, inputs["b"], len(counted))


@pytest.mark.parametrize("k_min", [2, 3])
def test_a_census_set_releases_exactly_the_classes_k_min_of_its_silos_hold(k_min):
    census = tail_guard.Census.of(["x", "y", "z"], [3, 2, 1, 0])
    expected = [c for c, n in enumerate([3, 2, 1, 0]) if 0 < n < k_min]
    assert census.guarded(["z", "y", "x"], k_min) == expected
    for other in itertools.chain(itertools.combinations("xyz", 2), [("x", "y", "z", "w")]):
        assert census.guarded(list(other), k_min) == [0, 1, 2, 3]
