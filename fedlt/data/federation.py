"""The recipe that turns an embedded dataset into a long-tailed, non-IID federation of silos.

Every step is seeded from one integer, so a silo process that knows (recipe, seed, its index) gets exactly the
shard the simulator gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.data.embedded import EMBEDDED, EMBEDDED_TABLES, load_embedded, split_balanced_test
from fedlt.data.longtail import longtail_subsample
from fedlt.data.partition import dirichlet_partition, label_skew
from fedlt.data.table import TableLayout, TableSchema
from fedlt.seeding import derive_seed


@dataclass(frozen=True)
class DataConfig:
    dataset: str = setting("mnist5k", choices=tuple(EMBEDDED), doc="embedded dataset")
    imbalance: float = setting(100.0, ge=1.0, doc="IF = n_max / n_min of the long tail")
    alpha: float = setting(0.5, gt=0.0, doc="Dirichlet concentration; smaller is more skewed")
    silos: int = setting(10, ge=1, le=1000)
    min_silo_size: int = setting(10, ge=1, doc="resample the partition until every silo has this many")
    test_per_class: int = setting(100, ge=1, doc="balanced test images held out per class")


@dataclass(frozen=True)
class Federation:
    silos: list[LabeledData]
    test: LabeledData
    train_counts: np.ndarray
    label_skew: float
    table: TableSchema | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        return self.test.classes

    @property
    def layout(self) -> TableLayout | None:
        """How the rows of a table federation are encoded; None for images."""
        return None if self.table is None else self.table.layout()


def build_federation(config: DataConfig, *, seed: int) -> Federation:
    data = load_embedded(config.dataset)
    train, test = split_balanced_test(
        data, per_class=config.test_per_class, seed=derive_seed(seed, "test-split")
    )
    train = longtail_subsample(train, imbalance=config.imbalance, seed=derive_seed(seed, "long-tail"))
    parts = dirichlet_partition(
        train.y,
        num_silos=config.silos,
        alpha=config.alpha,
        seed=derive_seed(seed, "partition"),
        min_size=config.min_silo_size,
    )
    return Federation(
        silos=[train.subset(p) for p in parts],
        test=test,
        train_counts=train.class_counts(),
        label_skew=label_skew(train.y, parts),
        table=EMBEDDED_TABLES.get(config.dataset),
    )
