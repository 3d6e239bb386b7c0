import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.data.partition import PartitionError, dirichlet_partition, label_skew


def _labels(counts):
    return np.concatenate([np.full(n, c) for c, n in enumerate(counts)]).astype(np.int64)


LT_COUNTS = [400, 239, 143, 86, 51, 30, 18, 11, 6, 4]


@given(
    seed=st.integers(0, 2**31),
    silos=st.integers(1, 12),
    alpha=st.floats(0.05, 100),
)
@settings(max_examples=60, deadline=None)
def test_every_sample_in_exactly_one_silo(seed, silos, alpha):
    labels = _labels(LT_COUNTS)
    parts = dirichlet_partition(labels, num_silos=silos, alpha=alpha, seed=seed, min_size=5)
    assert len(parts) == silos
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(labels)))
    assert min(len(p) for p in parts) >= 5


def test_seeded():
    labels = _labels(LT_COUNTS)
    a = dirichlet_partition(labels, num_silos=10, alpha=0.5, seed=4)
    b = dirichlet_partition(labels, num_silos=10, alpha=0.5, seed=4)
    c = dirichlet_partition(labels, num_silos=10, alpha=0.5, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def _mean_skew(labels, alpha, seed, draws=8):
    return np.mean(
        [
            label_skew(labels, dirichlet_partition(labels, num_silos=10, alpha=alpha, seed=seed + d))
            for d in range(draws)
        ]
    )


@given(
    seed=st.integers(0, 10_000),
    alpha=st.floats(0.05, 2.0),
    factor=st.floats(10.0, 50.0),
)
@settings(max_examples=25, deadline=None, derandomize=True)
def test_skew_grows_as_alpha_falls(seed, alpha, factor):
    labels = _labels([300] * 10)
    assert _mean_skew(labels, alpha, seed) > _mean_skew(labels, alpha * factor, seed)


def test_skew_is_zero_for_identical_silos_and_large_for_one_class_each():
    labels = _labels([10] * 4)
    iid = [np.flatnonzero(np.arange(40) % 2 == k) for k in range(2)]
    assert label_skew(labels, iid) == pytest.approx(0.0)
    one_class = [np.flatnonzero(labels == c) for c in range(4)]
    assert label_skew(labels, one_class) == pytest.approx(0.75)


def test_minimum_size_impossible_is_a_clear_error():
    labels = _labels([10, 10])
    with pytest.raises(PartitionError, match="cannot give 5 silos at least 10"):
        dirichlet_partition(labels, num_silos=5, alpha=1.0, seed=0, min_size=10)
    with pytest.raises(PartitionError, match="raise alpha or lower min_silo_size"):
        dirichlet_partition(_labels([1000, 2]), num_silos=4, alpha=0.001, seed=0, min_size=200, max_tries=5)
