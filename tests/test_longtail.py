import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedlt.data.arrays import LabeledData
from fedlt.data.longtail import longtail_counts, longtail_subsample


def test_known_counts_mnist5k_if100():
    # n_c = floor(400 * 100^(-c/9)): 400, 239.7, 143.7, 86.2, 51.7, 30.9, 18.5, 11.1, 6.6, 4.0
    assert longtail_counts(400, 10, 100) == [400, 239, 143, 86, 51, 30, 18, 11, 6, 4]


def test_known_counts_if10_five_classes():
    # 1000 * 10^(-c/4): 1000, 562.3, 316.2, 177.8, 100
    assert longtail_counts(1000, 5, 10) == [1000, 562, 316, 177, 100]


def test_balanced_when_imbalance_is_one():
    assert longtail_counts(37, 4, 1) == [37, 37, 37, 37]


@given(
    n_max=st.integers(1, 5000),
    num_classes=st.integers(2, 50),
    imbalance=st.floats(1, 1000, allow_nan=False),
)
def test_counts_shape_of_the_tail(n_max, num_classes, imbalance):
    counts = longtail_counts(n_max, num_classes, imbalance)
    assert counts[0] == n_max
    assert all(a >= b for a, b in itertools.pairwise(counts))
    assert counts[-1] == max(1, int(np.floor(n_max / imbalance + 1e-9)))
    assert min(counts) >= 1


def test_invalid_arguments():
    with pytest.raises(ValueError, match="two classes"):
        longtail_counts(10, 1, 10)
    with pytest.raises(ValueError, match=">= 1"):
        longtail_counts(10, 3, 0.5)


def _toy(counts):
    y = np.concatenate([np.full(n, c) for c, n in enumerate(counts)]).astype(np.int64)
    x = np.random.default_rng(0).random((len(y), 1, 2, 2), dtype=np.float32)
    return LabeledData(x, y, tuple(str(c) for c in range(len(counts))))


def test_subsample_takes_exact_counts_from_smallest_class_size():
    data = _toy([120, 100, 130, 110])  # n_max is the smallest class, 100
    cut = longtail_subsample(data, imbalance=10, seed=3)
    assert cut.class_counts().tolist() == longtail_counts(100, 4, 10) == [100, 46, 21, 10]


def test_subsample_is_seeded_and_draws_real_samples():
    data = _toy([50, 50, 50])
    a = longtail_subsample(data, imbalance=5, seed=1)
    b = longtail_subsample(data, imbalance=5, seed=1)
    c = longtail_subsample(data, imbalance=5, seed=2)
    assert np.array_equal(a.x, b.x)
    assert not np.array_equal(a.x, c.x)
    rows = {r.tobytes() for r in data.x}
    assert all(r.tobytes() in rows for r in a.x)
