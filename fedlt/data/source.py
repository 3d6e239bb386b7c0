"""A silo's own data as its files hold it, made ready for each plan: the one door between files and a round.

A silo opens its files when it starts (so unreadable files stop it at once), but only a plan says what the
data must look like: a table's schema, the model's image size and channels, the class names. `prepared`
turns the files into `LabeledData` for that plan at admission, before the silo takes any other step for the
round, and any mismatch is one `DataError` line (naming file, column and row where there are such), so the
silo refuses the round and its state stays as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedlt.data.arrays import LabeledData
from fedlt.data.files import open_source as open_image_source
from fedlt.data.images import ImageSettings
from fedlt.data.table import FORMATS as TABLE_SUFFIXES
from fedlt.data.table import RawTable, TableSchema, read_table
from fedlt.errors import DataError

TABLE_FORMATS = tuple(dict.fromkeys(TABLE_SUFFIXES.values()))
FORMATS = ("npz", "folder", "dicom", "cifar10", "idx", *TABLE_FORMATS)


class ImageFileSet(Protocol):
    """An image folder or a DICOM folder, opened but not decoded (`fedlt.data.files.open_source`)."""

    source: str

    def __len__(self) -> int: ...

    def prepared(self, image_shape: tuple[int, int, int], settings: ImageSettings) -> LabeledData: ...


@dataclass(frozen=True)
class Wanted:
    """What a plan wants of every silo's data (`RoundPlan.wanted`): rows of `table`, or images prepared per
    `images`; samples of `input_shape`; labels by the position of their name in `classes`."""

    table: TableSchema | None
    images: ImageSettings
    input_shape: tuple[int, ...]
    classes: tuple[str, ...]


class DataSource(Protocol):
    source: str

    def __len__(self) -> int:
        """Samples the source holds: with the plan's input shape, what sizes the prepared data."""

    def prepared(self, wanted: Wanted) -> LabeledData:
        """The data as the plan wants it, labelled by the plan's class names; a DataError if it cannot be."""


@dataclass(frozen=True)
class ArraySource:
    """Samples already in arrays: images decoded from an .npz, IDX or CIFAR files, or an embedded recipe's
    shard (images, or rows encoded by the embedded table's schema, `table`)."""

    data: LabeledData
    table: TableSchema | None = None

    @property
    def source(self) -> str:
        return self.data.source

    def __len__(self) -> int:
        return len(self.data)

    def prepared(self, wanted: Wanted) -> LabeledData:
        if wanted.table != self.table:
            raise DataError(
                self.source, f"holds {self._kind()}, but the plan's [data.table] asks for {_kind(wanted)}"
            )
        if self.data.input_shape != wanted.input_shape:
            raise DataError(
                self.source,
                f"holds images of shape {list(self.data.input_shape)}, but the plan's model takes "
                f"{list(wanted.input_shape)} (arrays are not resized: an image folder is, as the plan's "
                "[data.images] says)",
            )
        return self.data.in_label_space(wanted.classes)

    def _kind(self) -> str:
        return "images" if self.table is None else "rows of another table schema"


@dataclass(frozen=True)
class ImageSource:
    """Image files of any size, decoded and resized as the plan says (`fedlt.data.images`)."""

    files: ImageFileSet

    @property
    def source(self) -> str:
        return self.files.source

    def __len__(self) -> int:
        return len(self.files)

    def prepared(self, wanted: Wanted) -> LabeledData:
        _refuse_table_plan(wanted, self.source)
        if len(wanted.input_shape) != 3:
            raise DataError(
                self.source, f"holds images, but the plan's model takes {list(wanted.input_shape)}"
            )
        channels, height, width = wanted.input_shape
        return self.files.prepared((channels, height, width), wanted.images).in_label_space(wanted.classes)


@dataclass(frozen=True)
class TableSource:
    """A CSV or Parquet file, encoded by the plan's schema (`fedlt.data.table`)."""

    raw: RawTable

    @property
    def source(self) -> str:
        return str(self.raw.path)

    def __len__(self) -> int:
        return len(self.raw.frame)

    def prepared(self, wanted: Wanted) -> LabeledData:
        if wanted.table is None:
            raise DataError(self.source, "holds a table, but the plan is a study of images (no [data.table])")
        return self.raw.encode(wanted.table, wanted.classes)


@dataclass(frozen=True)
class Slice:
    """Every `parts`-th sample of a source from `part`, once prepared: silos sharing one held-out set split
    it."""

    whole: DataSource
    part: int
    parts: int

    @property
    def source(self) -> str:
        return self.whole.source

    def __len__(self) -> int:
        return len(range(self.part, len(self.whole), self.parts))

    def prepared(self, wanted: Wanted) -> LabeledData:
        data = self.whole.prepared(wanted)
        return data.subset(np.arange(self.part, len(data), self.parts))


def prepared_bytes(wanted: Wanted, sources: Sequence[DataSource]) -> int:
    """What `sources` take once prepared for `wanted`: float32 samples of its input shape."""
    return 4 * math.prod(wanted.input_shape) * sum(len(source) for source in sources)


def _refuse_table_plan(wanted: Wanted, source: str) -> None:
    if wanted.table is not None:
        raise DataError(source, "holds images, but the plan is a study of table rows ([data.table])")


def _kind(wanted: Wanted) -> str:
    return "images" if wanted.table is None else "rows of its own schema"


def open_source(path: str | Path, *, format: str | None = None, **options: Any) -> DataSource:
    """A silo's files by format (inferred when not given): a table (csv, parquet), an image or DICOM folder,
    or arrays (npz, cifar10, idx)."""
    if format in TABLE_FORMATS or (format is None and Path(path).suffix.lower() in TABLE_SUFFIXES):
        if options:
            raise DataError(path, f"a table file takes no options, got {', '.join(options)}")
        return TableSource(read_table(path, format))
    opened = open_image_source(path, format=format, **options)
    return ArraySource(opened) if isinstance(opened, LabeledData) else ImageSource(opened)


def embedded(data: LabeledData, table: TableSchema | None) -> DataSource:
    """An embedded recipe's shard (or held-out split) as a silo's source; `table`: the schema its rows are
    encoded by, for an embedded table."""
    return ArraySource(data, table)
