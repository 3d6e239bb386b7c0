"""A silo's tabular data: the schema a plan signs (`[data.table]`), the encoded layout every silo shares, and
CSV or Parquet files read with pandas and encoded into `LabeledData` rows.

Every silo encodes its own file by the plan's schema alone, so the same column always lands on the same
features, in [0, 1], whatever order or extra columns the file has: a numeric column u = (x − min)/(max − min)
(plus a missing indicator where the schema allows empty cells), a categorical column one-hot in the declared
order, the label by its class *name*. Columns the schema does not name never reach the encoded data.

A problem with the file is one `DataError` naming the file, the column and the first bad row (with how many
more rows share it) and never a cell's value: a silo's refusal may reach the aggregator, and a cell is the
silo's data.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlt.config import parse_section, setting
from fedlt.data.arrays import LabeledData
from fedlt.errors import DataError

if TYPE_CHECKING:  # pandas and pyarrow load where a table is read, not wherever a plan is
    import pandas as pd

KINDS = ("numeric", "categorical")
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True)
class Column:
    """One column of `[data.table.columns]`; the table's key is its name, the tables' order the features'."""

    name: str
    kind: str = setting("numeric", choices=KINDS)
    min: float | None = setting(None, doc="numeric: the smallest value allowed; required")
    max: float | None = setting(None, doc="numeric: the largest value allowed; required")
    categories: tuple[str, ...] | None = setting(
        None, doc="categorical: the values allowed, in one-hot order"
    )
    missing: bool = setting(False, doc="whether an empty cell is allowed")

    def to_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {"kind": self.kind}
        if self.min is not None:
            table["min"] = self.min
        if self.max is not None:
            table["max"] = self.max
        if self.categories is not None:
            table["categories"] = list(self.categories)
        table["missing"] = self.missing
        return table

    def problems(self, where: str) -> list[str]:
        """What the field checks cannot see: the settings each kind needs and what they must be."""
        problems = [] if _printable(self.name) else [f"{where}: the column's name is not printable"]
        if self.kind not in KINDS:
            return [
                *problems,
                f"{where}.kind: must be one of {', '.join(map(repr, KINDS))}, got {self.kind!r}",
            ]
        if self.kind == "numeric":
            return problems + self._range_problems(where)
        problems += [f"{where}.{key}: only numeric columns have a range" for key in self._set("min", "max")]
        return problems + _category_problems(self.categories, f"{where}.categories")

    def _range_problems(self, where: str) -> list[str]:
        problems = []
        if self.categories is not None:
            problems.append(f"{where}.categories: only categorical columns have categories")
        required = [key for key in ("min", "max") if getattr(self, key) is None]
        if required:
            return problems + [f"{where}.{key}: required for a numeric column" for key in required]
        low, high = float(self.min), float(self.max)  # type: ignore[arg-type]
        infinite = [key for key, value in (("min", low), ("max", high)) if not math.isfinite(value)]
        if infinite:
            return problems + [f"{where}.{key}: must be a finite number" for key in infinite]
        if not low < high:
            return [*problems, f"{where}.max: must be greater than min ({_number(low)}), got {_number(high)}"]
        if not math.isfinite(high - low):
            problems.append(f"{where}.max: max − min must be a finite number")
        return problems

    def _set(self, *keys: str) -> list[str]:
        return [key for key in keys if getattr(self, key) is not None]


def _category_problems(categories: tuple[str, ...] | None, where: str) -> list[str]:
    if not categories:
        return [f"{where}: required for a categorical column, a non-empty list of the values allowed"]
    repeated = sorted({name for name in categories if categories.count(name) > 1})
    unprintable = [name for name in categories if not _printable(name)]
    problems = [f"{where}: names {repeated} more than once"] if repeated else []
    if unprintable:
        problems.append(f"{where}: {unprintable} are not printable names (an empty cell is a missing value)")
    return problems


@dataclass(frozen=True)
class TableLayout:
    """The encoded features' names and, for each numeric column in order, the index of its value and of its
    missing indicator (-1 where it has none): what the Standardise layer needs to find the columns it
    scales."""

    features: tuple[str, ...]
    numeric: tuple[int, ...]
    indicators: tuple[int, ...]


@dataclass(frozen=True)
class TableSchema:
    """`[data.table]`: the label column and the feature columns, in order, that every silo's file must
    have."""

    label: str
    columns: tuple[Column, ...]

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, problems: list[str]) -> TableSchema:
        """The field checks of `fedlt.config`, per column; a column with a field problem is left out, so that
        `problems()` does not report it a second time."""
        for key in table:
            if key not in ("label", "columns"):
                problems.append(f"{where}.{key}: unknown setting (known: columns, label)")
        label = table.get("label", "")
        if not isinstance(label, str):
            problems.append(f"{where}.label: expected the label column's name as a string, got {label!r}")
            label = str(label)
        columns = table.get("columns", {})
        if not isinstance(columns, Mapping):
            problems.append(f"{where}.columns: expected a table of columns, got {type(columns).__name__}")
            columns = {}
        parsed = [
            _parse_column(name, value, f"{where}.columns.{name}", problems) for name, value in columns.items()
        ]
        return cls(label, tuple(column for column in parsed if column is not None))

    def to_table(self) -> dict[str, Any]:
        return {"label": self.label, "columns": {column.name: column.to_table() for column in self.columns}}

    def problems(self, where: str = "data.table") -> list[str]:
        """What the field checks cannot see, every problem at once, each with its TOML path."""
        problems = (
            [] if _printable(self.label) else [f"{where}.label: required, the label column's printable name"]
        )
        names = [column.name for column in self.columns]
        if not names:
            problems.append(f"{where}.columns: at least one feature column is needed")
        if self.label in names:
            problems.append(
                f"{where}.label: {self.label!r} is also a feature column; a label is not a feature"
            )
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            problems.append(f"{where}.columns: names {repeated} more than once")
        for column in self.columns:
            problems += column.problems(f"{where}.columns.{column.name}")
        if not problems:
            features = self.layout().features
            collide = sorted({name for name in features if features.count(name) > 1})
            if collide:
                problems.append(f"{where}.columns: the encoded features {collide} collide; rename a column")
        return problems

    def layout(self) -> TableLayout:
        """Numeric: the value, then `name:missing` where empty cells are allowed; categorical: `name=category`
        for each declared category (an empty cell is all zeros, so it needs no indicator)."""
        features: list[str] = []
        numeric: list[int] = []
        indicators: list[int] = []
        for column in self.columns:
            if column.kind == "numeric":
                numeric.append(len(features))
                features.append(column.name)
                indicators.append(len(features) if column.missing else -1)
                if column.missing:
                    features.append(f"{column.name}:missing")
            else:
                features += [f"{column.name}={category}" for category in column.categories or ()]
        return TableLayout(tuple(features), tuple(numeric), tuple(indicators))


def _parse_column(name: str, table: Any, where: str, problems: list[str]) -> Column | None:
    if not isinstance(table, Mapping):
        problems.append(f"{where}: expected a table (kind, ...), got {type(table).__name__}")
        return None
    mine: list[str] = []
    if "name" in table:
        mine.append(f"{where}.name: unknown setting (a column's name is its table's key)")
    if "kind" not in table:
        mine.append(f"{where}.kind: required, one of {', '.join(map(repr, KINDS))}")
    column = parse_section(Column, {**table, "name": name}, where, mine)
    problems += mine
    return None if mine else column


@dataclass(frozen=True, eq=False)
class RawTable:
    """A file's cells as written, before any schema: CSV cells as text, Parquet columns as their stored types.
    `rows[i]` is where a person finds frame row i: its line for CSV (the header is line 1), its 1-based
    position for Parquet."""

    path: Path
    frame: pd.DataFrame
    rows: np.ndarray = field(repr=False)

    def encode(self, schema: TableSchema, classes: tuple[str, ...]) -> LabeledData:
        """Features by `schema.layout()`, labels by the position of their name in `classes` (a plan's label
        space); every problem in the file at once, as one DataError."""
        problems: list[str] = []
        x = self._features(schema, (schema.label,), problems)
        y = _encode_label(schema.label, self.frame[schema.label], classes, self.rows, problems)
        if problems:
            raise DataError(self.path, "; ".join(problems))
        return LabeledData(x, y, tuple(classes), str(self.path))

    def features(self, schema: TableSchema) -> np.ndarray:
        """The rows encoded by `schema.layout()` without labels: the input of a model exported from a table
        study, for rows to predict."""
        problems: list[str] = []
        x = self._features(schema, (), problems)
        if problems:
            raise DataError(self.path, "; ".join(problems))
        return x

    def _features(self, schema: TableSchema, also: tuple[str, ...], problems: list[str]) -> np.ndarray:
        lacking = [name for name in (*also, *(c.name for c in schema.columns)) if name not in self.frame]
        if lacking:
            raise DataError(self.path, f"has no column {', '.join(map(repr, lacking))} (named in data.table)")
        if self.frame.empty:
            raise DataError(self.path, "has no rows")
        blocks = [
            _encode_column(column, self.frame[column.name], self.rows, problems) for column in schema.columns
        ]
        return np.concatenate(blocks, axis=1).astype(np.float32)


def read_table(path: str | Path, format: str | None = None) -> RawTable:
    """The file's cells, read by pandas without guessing types (CSV: every cell as text; only an empty cell is
    missing, so a category called "NA" or "None" stays itself). Lines with no value at all are skipped, as a
    reader skips them; a line break inside a quoted cell is the one thing that makes CSV row numbers run
    behind the file's lines."""
    import pandas as pd
    import pyarrow as pa

    path = Path(path)
    kind = format or FORMATS.get(path.suffix.lower())
    if kind not in FORMATS.values():
        allowed = "format='csv' or format='parquet'"
        reason = f"unknown format {format!r}" if format else f"cannot tell the format from {path.suffix!r}"
        raise DataError(path, f"{reason}; name files .csv, .parquet or .pq, or pass {allowed}")
    try:
        if kind == "csv":
            return _read_csv(path)
        frame = pd.read_parquet(path, engine="pyarrow").reset_index(drop=True)
    except (OSError, ValueError, pa.ArrowException, pd.errors.ParserWarning) as exc:
        raise DataError(path, f"cannot be read as {kind.upper()}: {_read_error(exc)}") from exc
    return RawTable(path, frame, frame.index.to_numpy() + 1)


def _read_csv(path: Path) -> RawTable:
    """A row with more cells than the header is an error: pandas would otherwise drop the extra cells
    (`index_col=False`, with a warning) or take the first column for an index and shift every cell."""
    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.ParserWarning)
        frame = pd.read_csv(
            path, dtype=str, keep_default_na=False, na_values=[""], skip_blank_lines=False, index_col=False
        )
    frame = frame[frame.notna().any(axis=1)]
    return RawTable(path, frame, frame.index.to_numpy() + 2)


def _read_error(exc: Exception) -> str:
    """The reader's reason, without any piece of the file: a decoding error's message quotes the byte (and
    its position is one within a cell, no help in finding it)."""
    import pandas as pd

    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text; save it as UTF-8"
    if isinstance(exc, pd.errors.EmptyDataError):
        return "the file is empty"
    if isinstance(exc, pd.errors.ParserWarning):
        return "a row has more cells than the header has columns"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__


def _encode_column(column: Column, cells: pd.Series, rows: np.ndarray, problems: list[str]) -> np.ndarray:
    empty = cells.isna().to_numpy()
    where = f"column {column.name!r}"
    if empty.any() and not column.missing:
        problems.append(_problem(where, "empty, and data.table allows no missing values here", empty, rows))
    if column.kind == "numeric":
        return _encode_numeric(column, cells, empty, rows, problems)
    return _encode_categorical(column, cells, empty, rows, problems)


def _encode_numeric(
    column: Column, cells: pd.Series, empty: np.ndarray, rows: np.ndarray, problems: list[str]
) -> np.ndarray:
    low, high = float(column.min), float(column.max)  # type: ignore[arg-type]
    values = _numbers(cells)
    where = f"column {column.name!r}"
    not_number = ~empty & np.isnan(values)
    if not_number.any():
        problems.append(_problem(where, "not a number", not_number, rows))
    with np.errstate(invalid="ignore"):
        outside = ~empty & ~np.isnan(values) & ~((values >= low) & (values <= high))
    if outside.any():
        problems.append(_problem(where, f"outside [{_number(low)}, {_number(high)}]", outside, rows))
    u = np.where(empty | not_number | outside, 0.0, (values - low) / (high - low))
    return np.stack([u, empty.astype(np.float64)], axis=1) if column.missing else u[:, None]


def _numbers(cells: pd.Series) -> np.ndarray:
    """float64 values, NaN where a cell is empty or no number: text (CSV) is parsed by pandas, a stored
    number (Parquet) kept, anything else (a date, a list) is no number."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(cells) or pd.api.types.is_numeric_dtype(cells):
        return cells.to_numpy(dtype=np.float64, na_value=np.nan)
    if pd.api.types.is_string_dtype(cells):
        return pd.to_numeric(cells, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    return np.full(len(cells), np.nan)


def _encode_categorical(
    column: Column, cells: pd.Series, empty: np.ndarray, rows: np.ndarray, problems: list[str]
) -> np.ndarray:
    categories = column.categories or ()
    codes = _codes(cells, categories, f"column {column.name!r}", rows, problems)
    undeclared = ~empty & (codes == _UNDECLARED)
    if undeclared.any():
        what = f"not one of the {len(categories)} declared categories"
        problems.append(_problem(f"column {column.name!r}", what, undeclared, rows))
    onehot = np.zeros((len(cells), len(categories)))
    known = codes >= 0
    onehot[np.flatnonzero(known), codes[known]] = 1.0
    return onehot


def _encode_label(
    name: str, cells: pd.Series, classes: tuple[str, ...], rows: np.ndarray, problems: list[str]
) -> np.ndarray:
    empty = cells.isna().to_numpy()
    where = f"label column {name!r}"
    if empty.any():
        problems.append(_problem(where, "empty (every row needs its class)", empty, rows))
    codes = _codes(cells, classes, where, rows, problems)
    unknown = ~empty & (codes == _UNDECLARED)
    if unknown.any():
        what = (
            f"not one of the plan's classes {list(classes)} (matched by name, an integer label by its "
            "digits: ask the operator to add a class to [model] classes)"
        )
        problems.append(_problem(where, what, unknown, rows))
    return codes


_UNDECLARED = -1
_NO_TEXT = -2


def _codes(
    cells: pd.Series, names: tuple[str, ...], where: str, rows: np.ndarray, problems: list[str]
) -> np.ndarray:
    """Each cell's position in `names` by its text, `_UNDECLARED` where the text is none of them (or the cell
    is empty), `_NO_TEXT` where a stored value has no text to match (a fraction, a date): reported here."""
    position = {name: index for index, name in enumerate(names)}
    texts = _texts(cells)
    codes = np.array(
        [position.get(text, _UNDECLARED) if isinstance(text, str) else _UNDECLARED for text in texts]
    )
    no_text = cells.notna().to_numpy() & texts.isna().to_numpy()
    if no_text.any():
        problems.append(_problem(where, "neither text nor a whole number", no_text, rows))
    codes[no_text] = _NO_TEXT
    return codes.astype(np.int64)


def _texts(cells: pd.Series) -> pd.Series:
    """A cell's text: as written for text, the digits of a whole number (Parquet's integer labels read as
    "0", "1", ...), `true`/`false` for a boolean, missing for anything else."""
    import pandas as pd

    if pd.api.types.is_string_dtype(cells):
        return cells
    if pd.api.types.is_bool_dtype(cells):
        return cells.map(lambda v: None if pd.isna(v) else str(bool(v)).lower())
    if pd.api.types.is_numeric_dtype(cells):
        return cells.map(lambda v: str(int(v)) if math.isfinite(v) and float(v).is_integer() else None)
    return pd.Series([None] * len(cells), index=cells.index, dtype=object)


def _problem(where: str, what: str, bad: np.ndarray, rows: np.ndarray) -> str:
    """The first bad row and how many more: enough to find them, never a cell's value."""
    found = rows[bad]
    more = f" (and {len(found) - 1} more row{'s' * (len(found) > 2)})" if len(found) > 1 else ""
    return f"{where}, row {int(found[0])}: {what}{more}"


def _number(value: float) -> str:
    """120.0 as `120`, as a person writes a range."""
    return str(int(value)) if value.is_integer() else repr(value)


def _printable(name: str) -> bool:
    return bool(name.strip()) and name.isprintable()
