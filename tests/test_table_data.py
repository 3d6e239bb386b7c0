"""Tabular data: the plan's schema, CSV and Parquet read and encoded by it, one clear DataError per mistake
that never quotes a cell, and the long-tailed synthetic table with its CLI."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlt.config import render_toml
from fedlt.data import synthetic_table
from fedlt.data.longtail import longtail_counts
from fedlt.data.synthetic_table import long_tailed_table
from fedlt.data.table import Column, RawTable, TableLayout, TableSchema, read_table
from fedlt.errors import DataError

SCHEMA_TOML = """
[data.table]
label = "outcome"
[data.table.columns.age]
kind = "numeric"
min = 0
max = 120.0
[data.table.columns.ward]
kind = "categorical"
categories = ["A", "B", "ICU"]
missing = true
[data.table.columns.bmi]
kind = "numeric"
min = 10.0
max = 60.0
missing = true
"""
CLASSES = ("no", "yes")


def _schema(text: str = SCHEMA_TOML) -> tuple[TableSchema, list[str]]:
    problems: list[str] = []
    schema = TableSchema.from_table(tomllib.loads(text)["data"]["table"], "data.table", problems)
    return schema, problems + schema.problems()


SCHEMA = _schema()[0]


# --- the schema ----------------------------------------------------------------------------------


def test_the_schema_reads_as_written_and_comes_back_from_its_toml():
    schema, problems = _schema()
    assert problems == []
    assert schema == TableSchema(
        "outcome",
        (
            Column("age", "numeric", 0.0, 120.0),
            Column("ward", "categorical", categories=("A", "B", "ICU"), missing=True),
            Column("bmi", "numeric", 10.0, 60.0, missing=True),
        ),
    )
    problems = []
    again = TableSchema.from_table(tomllib.loads(render_toml(schema.to_table())), "data.table", problems)
    assert (again, problems) == (schema, [])
    in_a_plan = tomllib.loads(render_toml({"data": {"table": schema.to_table()}}))
    assert TableSchema.from_table(in_a_plan["data"]["table"], "data.table", []) == schema


def test_column_names_toml_cannot_write_bare_are_quoted_and_read_back():
    schema = TableSchema(
        "outcome (30 days)",
        (Column("amount (EUR)", "numeric", 0.0, 1.0), Column("a.b", "categorical", categories=("x y",))),
    )
    text = render_toml({"data": {"table": schema.to_table()}})
    assert '[data.table.columns."amount (EUR)"]' in text
    assert TableSchema.from_table(tomllib.loads(text)["data"]["table"], "data.table", []) == schema


def test_the_layout_names_each_feature_and_points_at_values_and_indicators():
    assert SCHEMA.layout() == TableLayout(
        features=("age", "ward=A", "ward=B", "ward=ICU", "bmi", "bmi:missing"),
        numeric=(0, 4),
        indicators=(-1, 5),
    )


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("label = 5\n[columns.a]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.label: expected the label column's name as a string, got 5"]),
        ("[columns.a]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.label: required, the label column's printable name"]),
        ("label = 'y'\nlable = 'y'\n[columns.a]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.lable: unknown setting (known: columns, label)"]),
        ("label = 'y'", ["data.table.columns: at least one feature column is needed"]),
        ("label = 'a'\n[columns.a]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.label: 'a' is also a feature column; a label is not a feature"]),
        ("label = 'y'\n[columns.a]\nmin = 0\nmax = 1",
         ["data.table.columns.a.kind: required, one of 'numeric', 'categorical'",
          "data.table.columns: at least one feature column is needed"]),
        ("label = 'y'\n[columns.a]\nkind = 'text'\n[columns.b]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.columns.a.kind: must be one of 'numeric', 'categorical', got 'text'"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmin = 'zero'\nmax = 1\n[columns.b]\nkind = 'numeric'\n"
         "min = 0\nmax = 1", ["data.table.columns.a.min: expected float, got a string 'zero'"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nname = 'b'\nmin = 0\nmax = 1\n"
         "[columns.b]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.columns.a.name: unknown setting (a column's name is its table's key)"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmax = 1",
         ["data.table.columns.a.min: required for a numeric column"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmin = 5\nmax = 1",
         ["data.table.columns.a.max: must be greater than min (5), got 1"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmin = -inf\nmax = nan",
         ["data.table.columns.a.min: must be a finite number",
          "data.table.columns.a.max: must be a finite number"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmin = -1e308\nmax = 1e308",
         ["data.table.columns.a.max: max − min must be a finite number"]),
        ("label = 'y'\n[columns.a]\nkind = 'numeric'\nmin = 0\nmax = 1\ncategories = ['x']",
         ["data.table.columns.a.categories: only categorical columns have categories"]),
        ("label = 'y'\n[columns.c]\nkind = 'categorical'",
         ["data.table.columns.c.categories: required for a categorical column, a non-empty list of "
          "the values allowed"]),
        ("label = 'y'\n[columns.c]\nkind = 'categorical'\ncategories = []",
         ["data.table.columns.c.categories: required for a categorical column, a non-empty list of "
          "the values allowed"]),
        ("label = 'y'\n[columns.c]\nkind = 'categorical'\ncategories = ['x', 'x', '', 'y']\nmin = 1",
         ["data.table.columns.c.min: only numeric columns have a range",
          "data.table.columns.c.categories: names ['x'] more than once",
          "data.table.columns.c.categories: [''] are not printable names "
          "(an empty cell is a missing value)"]),
        ("label = 'y'\n[columns.\"a\\tb\"]\nkind = 'numeric'\nmin = 0\nmax = 1",
         ["data.table.columns.a\tb: the column's name is not printable"]),
        ("label = 'y'\n[columns.\"amount (EUR)\"]\nkind = 'numeric'\nmin = 0\nmax = 1\n"
         "[columns.\"a.b\"]\nkind = 'numeric'\nmin = 0\nmax = 1",
         []),
        ("label = 'y'\n[columns.\"a=b\"]\nkind = 'numeric'\nmin = 0\nmax = 1\n"
         "[columns.a]\nkind = 'categorical'\ncategories = ['b']",
         ["data.table.columns: the encoded features ['a=b'] collide; rename a column"]),
    ],
)  # fmt: skip
def test_each_malformed_schema_gives_exactly_its_problems(toml, expected):
    problems: list[str] = []
    schema = TableSchema.from_table(tomllib.loads(toml), "data.table", problems)
    assert problems + schema.problems() == expected


def test_a_schema_built_in_python_is_checked_as_one_from_toml():
    schema = TableSchema("y", (Column("a", "numeric"), Column("a", "categorical", categories=("u",))))
    assert schema.problems() == [
        "data.table.columns: names ['a'] more than once",
        "data.table.columns.a.min: required for a numeric column",
        "data.table.columns.a.max: required for a numeric column",
    ]


# --- reading and encoding ------------------------------------------------------------------------


def test_a_small_csv_encodes_to_the_known_answer(tmp_path):
    path = tmp_path / "train.csv"
    # an extra column the schema does not name, columns in an order of the file's own, a blank line skipped
    path.write_text("id,outcome,bmi,ward,age,ssn\n1,yes,,A,30,111\n2,no,20,,120,222\n\n3,yes,60,ICU,0,333\n")
    data = read_table(path).encode(SCHEMA, CLASSES)
    expected = [[0.25, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0.2, 0], [0, 0, 0, 1, 1, 0]]
    np.testing.assert_array_equal(data.x, np.array(expected, dtype=np.float32))
    assert data.x.dtype == np.float32
    np.testing.assert_array_equal(data.y, [1, 0, 1])
    assert data.classes == CLASSES
    assert data.source == str(path)
    assert data.input_shape == (6,)


def test_labels_go_by_name_whatever_the_plans_order():
    raw = RawTable(
        Path("t.csv"), pd.DataFrame({"y": ["b", "a", "c"], "v": ["0", "1", "1"]}), np.arange(3) + 2
    )
    schema = TableSchema("y", (Column("v", "numeric", 0.0, 1.0),))
    np.testing.assert_array_equal(raw.encode(schema, ("c", "a", "b")).y, [2, 1, 0])


def test_na_and_none_are_categories_not_missing_values_in_csv(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,c\nu,NA\nu,None\nu,\n")
    schema = TableSchema("y", (Column("c", "categorical", categories=("NA", "None"), missing=True),))
    np.testing.assert_array_equal(read_table(path).encode(schema, ("u",)).x, [[1, 0], [0, 1], [0, 0]])


def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "age": [30.0, 120.0, 0.0, 47.5],
            "ward": ["A", None, "ICU", "B"],
            "bmi": [np.nan, 20.0, 60.0, 33.3],
            "outcome": ["yes", "no", "yes", "no"],
            "note": ["x", "y", "z", "w"],
        }
    )


@pytest.mark.parametrize("suffix", [".parquet", ".pq"])
def test_csv_and_parquet_of_one_frame_encode_identically(tmp_path, suffix):
    frame = _frame()
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / f"t{suffix}", index=False)
    from_csv = read_table(tmp_path / "t.csv").encode(SCHEMA, CLASSES)
    from_parquet = read_table(tmp_path / f"t{suffix}").encode(SCHEMA, CLASSES)
    np.testing.assert_array_equal(from_csv.x, from_parquet.x)
    np.testing.assert_array_equal(from_csv.y, from_parquet.y)
    assert from_csv.classes == from_parquet.classes


def test_parquet_integer_labels_read_as_their_digits_and_the_format_can_be_named(tmp_path):
    path = tmp_path / "data.bin"
    pd.DataFrame({"y": [2, 0, 1], "v": [0.0, 0.5, 1.0]}).to_parquet(path, index=False)
    schema = TableSchema("y", (Column("v", "numeric", 0.0, 1.0),))
    data = read_table(path, format="parquet").encode(schema, ("0", "1", "2"))
    np.testing.assert_array_equal(data.y, [2, 0, 1])


def test_pandas_category_columns_in_parquet_read_as_their_text(tmp_path):
    path = tmp_path / "t.parquet"
    frame = _frame().assign(
        ward=lambda f: f.ward.astype("category"), outcome=lambda f: f.outcome.astype("category")
    )
    frame.to_parquet(path, index=False)
    _frame().to_csv(tmp_path / "t.csv", index=False)
    expected = read_table(tmp_path / "t.csv").encode(SCHEMA, CLASSES)
    data = read_table(path).encode(SCHEMA, CLASSES)
    np.testing.assert_array_equal(data.x, expected.x)
    np.testing.assert_array_equal(data.y, expected.y)


SECRET = "7319.25"  # the bad cell in every case below: no message may quote it


def _csv(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "ward-7.csv"
    path.write_text(body.replace("SECRET", SECRET))
    return path


def _parquet(tmp_path: Path, frame: pd.DataFrame) -> Path:
    path = tmp_path / "ward-7.parquet"
    frame.to_parquet(path, index=False)
    return path


GOOD_ROW = "30,A,20,yes"
HEADER = "age,ward,bmi,outcome"


@pytest.mark.parametrize(
    ("make", "column", "row", "what"),
    [
        (lambda p: _csv(p, f"{HEADER}\n{GOOD_ROW}\nx{SECRET}y,A,20,yes\n"), "age", 3, "not a number"),
        (lambda p: _csv(p, f"{HEADER}\n{GOOD_ROW}\nSECRET,A,20,yes\nSECRET,B,20,no\n"), "age", 3,
         r"outside \[0, 120\] \(and 1 more row\)"),
        (lambda p: _csv(p, f"{HEADER}\n,A,SECRET,yes\n"), "age", 2,
         "empty, and data.table allows no missing values here"),
        (lambda p: _csv(p, f"{HEADER}\n{GOOD_ROW}\n{GOOD_ROW}\n30,SECRET,20,yes\n"), "ward", 4,
         "not one of the 3 declared categories"),
        (lambda p: _csv(p, f"{HEADER}\n30,A,20,SECRET\n{GOOD_ROW}\n30,A,20,SECRET\n30,A,20,SECRET\n"),
         "outcome", 2, r"not one of the plan's classes \['no', 'yes'\].* \(and 2 more rows\)"),
        (lambda p: _csv(p, f"{HEADER}\n{GOOD_ROW}\n30,A,SECRET,\n"), "outcome", 3, "empty"),
        (lambda p: _parquet(p, _frame().assign(age=[30.0, 7319.25, 1.0, 2.0])), "age", 2,
         r"outside \[0, 120\]"),
        (lambda p: _parquet(p, _frame().assign(outcome=[1.0, 2.0, 7319.25, 0.0])), "outcome", 3,
         "neither text nor a whole number"),
        (lambda p: _parquet(p, _frame().assign(ward=["A", "A", "A", "SECRET"])), "ward", 4,
         "not one of the 3 declared categories"),
    ],
)  # fmt: skip
def test_each_bad_cell_is_one_line_naming_file_column_and_row_but_not_the_value(
    tmp_path, make, column, row, what
):
    path = make(tmp_path)
    with pytest.raises(DataError) as raised:
        read_table(path).encode(SCHEMA, CLASSES)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert re.search(rf"column '{column}', row {row}: {what}", message), message
    assert SECRET not in message
    assert "SECRET" not in message


def test_every_problem_in_a_file_is_in_its_one_error(tmp_path):
    path = _csv(tmp_path, f"{HEADER}\nabc,Q,20,yes\n200,A,99,maybe\n")
    with pytest.raises(DataError) as raised:
        read_table(path).encode(SCHEMA, CLASSES)
    assert str(raised.value).split(": ", 1)[1].split("; ") == [
        "column 'age', row 2: not a number",
        "column 'age', row 3: outside [0, 120]",
        "column 'ward', row 2: not one of the 3 declared categories",
        "column 'bmi', row 3: outside [10, 60]",
        "label column 'outcome', row 3: not one of the plan's classes ['no', 'yes'] (matched by name, an "
        "integer label by its digits: ask the operator to add a class to [model] classes)",
    ]


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("t.csv", "age,ward,outcome\n30,A,yes\n", r"has no column 'bmi' \(named in data.table\)"),
        ("t.csv", "note,ward\n1,A\n", r"has no column 'outcome', 'age', 'bmi'"),
        ("t.csv", f"{HEADER}\n", "has no rows"),
        ("t.csv", f"{HEADER}\n\n,,,\n", "has no rows"),
        ("t.csv", "", "cannot be read as CSV: the file is empty"),
        ("t.csv", f"{HEADER}\n30,A,20,yes,{SECRET}\n", "a row has more cells than the header has columns"),
        ("t.csv", f"{HEADER}\n{GOOD_ROW}\n30,A,20,yes,{SECRET}\n", r"Expected 4 fields in line 3, saw 5"),
        ("t.csv", f'{HEADER}\n"{SECRET},A,20,yes\n', "EOF inside string"),
        ("t.parquet", f"{SECRET} is not parquet", "cannot be read as PARQUET"),
        ("t.txt", f"{HEADER}\n", r"cannot tell the format from '.txt'.*format='csv' or format='parquet'"),
    ],
)
def test_each_unusable_file_is_one_clear_line(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match) as raised:
        read_table(path).encode(SCHEMA, CLASSES)
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith(str(path))
    assert SECRET not in str(raised.value)


def test_a_file_that_is_not_utf8_is_refused_without_quoting_its_bytes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(f"{HEADER}\n30,A,20,".encode() + "señal".encode("latin-1") + b"\n")
    with pytest.raises(DataError, match=r"as CSV: not UTF-8 text; save it as UTF-8$") as raised:
        read_table(path)
    assert "0xf1" not in str(raised.value)  # pandas' own message: "can't decode byte 0xf1 in position 2"


def test_missing_files_and_unknown_formats_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="cannot be read as CSV: no such file or directory"):
        read_table(tmp_path / "absent.csv")
    with pytest.raises(DataError, match="unknown format 'xlsx'"):
        read_table(tmp_path / "t.csv", format="xlsx")


# --- a property over random valid tables -----------------------------------------------------------


@st.composite
def _tables(draw):
    """A valid schema and a frame of cells that satisfy it, as floats, text and empties."""
    columns, cells = [], {}
    rows = draw(st.integers(1, 12))
    for index in range(draw(st.integers(1, 4))):
        missing = draw(st.booleans())
        if draw(st.booleans()):
            low = draw(st.floats(-1e6, 1e6))
            high = low + draw(st.floats(1e-3, 1e6))
            values = st.floats(low, high) if not missing else st.one_of(st.none(), st.floats(low, high))
            columns.append(Column(f"n{index}", "numeric", low, high, missing=missing))
        else:
            categories = tuple(
                draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True))
            )
            values = st.sampled_from(categories) if not missing else st.sampled_from((*categories, None))
            columns.append(Column(f"c{index}", "categorical", categories=categories, missing=missing))
        cells[columns[-1].name] = [draw(values) for _ in range(rows)]
    cells["y"] = [draw(st.sampled_from(("p", "q"))) for _ in range(rows)]
    return TableSchema("y", tuple(columns)), pd.DataFrame(cells)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=_tables())
def test_random_valid_tables_encode_into_the_unit_box_by_their_layout(tmp_path, table):
    schema, frame = table
    assert schema.problems() == []
    path = tmp_path / "t.csv"
    frame.to_csv(path, index=False)
    data = read_table(path).encode(schema, ("p", "q"))
    layout = schema.layout()
    assert data.x.shape == (len(frame), len(layout.features))
    assert ((data.x >= 0) & (data.x <= 1)).all()
    numeric = [c for c in schema.columns if c.kind == "numeric"]
    assert len(layout.numeric) == len(layout.indicators) == len(numeric)
    for column, at, indicator in zip(numeric, layout.numeric, layout.indicators, strict=True):
        assert layout.features[at] == column.name
        empty = frame[column.name].isna().to_numpy()
        if column.missing:
            assert layout.features[indicator] == f"{column.name}:missing"
            np.testing.assert_array_equal(data.x[:, indicator], empty)
        else:
            assert indicator == -1
        u = (frame[column.name].astype(float).fillna(column.min) - column.min) / (column.max - column.min)
        np.testing.assert_allclose(data.x[:, at], u, atol=1e-6)
    for column in (c for c in schema.columns if c.kind == "categorical"):
        at = [layout.features.index(f"{column.name}={category}") for category in column.categories]
        np.testing.assert_array_equal(at, range(at[0], at[0] + len(at)))
        onehot = data.x[:, at]
        assert (onehot.sum(axis=1) <= 1).all()
        expected = [column.categories.index(v) if isinstance(v, str) else -1 for v in frame[column.name]]
        np.testing.assert_array_equal(np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1), expected)


# --- the synthetic long-tailed table --------------------------------------------------------------


def test_the_synthetic_table_is_bit_identical_for_a_seed_and_follows_the_long_tail():
    one, again, other = long_tailed_table(3), long_tailed_table(3), long_tailed_table(4)
    assert one.train.to_csv(index=False) == again.train.to_csv(index=False)
    assert one.test.to_csv(index=False) == again.test.to_csv(index=False)
    pd.testing.assert_frame_equal(one.train, again.train, check_exact=True)
    assert one.train.to_csv(index=False) != other.train.to_csv(index=False)
    counts = one.train["label"].value_counts()
    assert [counts[name] for name in one.classes] == longtail_counts(500, 10, 100.0)
    assert one.test["label"].value_counts().to_dict() == dict.fromkeys(one.classes, 100)
    assert one.schema.problems() == []
    both = pd.concat([one.train, one.test])
    for name in ("amount", "channel"):
        assert 0.02 < both[name].isna().mean() < 0.08
    assert both.drop(columns=["amount", "channel"]).notna().all().all()


def test_a_smaller_synthetic_table_keeps_its_profile():
    table = long_tailed_table(0, classes=4, n_max=40, imbalance=10.0, test_per_class=7)
    counts = table.train["label"].value_counts()
    assert [counts[name] for name in table.classes] == longtail_counts(40, 4, 10.0) == [40, 18, 8, 4]
    assert (table.test["label"].value_counts() == 7).all()


def test_the_synthetic_cli_writes_silo_files_that_read_back(tmp_path, capsys):
    out = tmp_path / "tables"
    assert (
        synthetic_table.main(["--out", str(out), "--silos", "3", "--seed", "1", "--format", "parquet"]) == 0
    )
    tree = tomllib.loads((out / "schema.toml").read_text())
    problems: list[str] = []
    schema = TableSchema.from_table(tree["data"]["table"], "data.table", problems)
    assert (problems, schema) == ([], synthetic_table.SCHEMA)
    table = long_tailed_table(1)
    train, held_out = [], []
    for k in range(3):
        train.append(read_table(out / f"silo-{k}" / "train.parquet").encode(schema, table.classes))
        held_out.append(read_table(out / f"silo-{k}" / "held-out.parquet").encode(schema, table.classes))
    assert sum(len(d) for d in train) == len(table.train)
    assert sum(len(d) for d in held_out) == len(table.test)
    assert sum(d.class_counts() for d in train).tolist() == longtail_counts(500, 10, 100.0)
    assert len({tuple(d.class_counts()) for d in train}) == 3  # a label skew, not copies
    assert "schema.toml" in capsys.readouterr().out


def test_the_synthetic_cli_writes_csv_and_refuses_a_folder_in_use(tmp_path, capsys):
    out = tmp_path / "tables"
    assert synthetic_table.main(["--out", str(out), "--silos", "2"]) == 0
    schema = synthetic_table.SCHEMA
    data = read_table(out / "silo-1" / "train.csv").encode(schema, long_tailed_table(0).classes)
    assert data.input_shape == (len(schema.layout().features),)
    capsys.readouterr()
    assert synthetic_table.main(["--out", str(out), "--silos", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {out} is not an empty folder")
    assert synthetic_table.main(["--out", str(out / "schema.toml")]) == 2
