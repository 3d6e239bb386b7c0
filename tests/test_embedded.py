import numpy as np
import pytest

from fedlt.data.arrays import LabeledData
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.data.federation import DataConfig, build_federation
from fedlt.errors import DataError


def test_mnist5k_is_scaled_28x28():
    data = load_embedded("mnist5k")
    assert data.x.shape == (5000, 1, 28, 28)
    assert data.x.dtype == np.float32
    assert data.x.min() == 0.0
    assert data.x.max() == 1.0
    assert data.class_counts().tolist() == [500] * 10


def test_digits_is_scaled_8x8():
    data = load_embedded("digits")
    assert data.x.shape == (1797, 1, 8, 8)
    assert data.x.max() == 1.0


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(DataError, match="allowed: mnist5k, digits"):
        load_embedded("cifar1000")


def test_balanced_test_split_is_disjoint_and_balanced():
    y = np.repeat(np.arange(4), [12, 9, 15, 10]).astype(np.int64)
    x = (np.arange(len(y), dtype=np.float32) / len(y)).reshape(-1, 1, 1, 1)  # each row names its index
    data = LabeledData(x, y, ("a", "b", "c", "d"))
    train, test = split_balanced_test(data, per_class=3, seed=0)
    assert test.class_counts().tolist() == [3, 3, 3, 3]
    train_idx, test_idx = set(train.x.ravel().tolist()), set(test.x.ravel().tolist())
    assert not train_idx & test_idx
    assert train_idx | test_idx == set(x.ravel().tolist())
    again, _ = split_balanced_test(data, per_class=3, seed=0)
    assert np.array_equal(again.x, train.x)


def test_test_split_larger_than_a_class_is_refused():
    with pytest.raises(DataError, match="leaves no training data"):
        split_balanced_test(load_embedded("digits"), per_class=500, seed=0)


def test_federation_held_out_test_before_the_tail():
    fed = build_federation(DataConfig(dataset="mnist5k", imbalance=100, silos=10), seed=0)
    assert fed.test.class_counts().tolist() == [100] * 10
    assert fed.train_counts.tolist() == [400, 239, 143, 86, 51, 30, 18, 11, 6, 4]
    assert sum(len(s) for s in fed.silos) == fed.train_counts.sum()
    assert np.array_equal(sum(s.class_counts() for s in fed.silos), fed.train_counts)
