"""A silo's files opened at start and prepared for each plan at admission (`fedlt.data.source`): the right
kind of data for the plan, or one clear line and a refusal that leaves the silo as it was."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from fedlt.config import read_toml, render_toml
from fedlt.data.arrays import LabeledData
from fedlt.data.images import ImageSettings
from fedlt.data.source import ArraySource, ImageSource, Slice, TableSource, Wanted, open_source
from fedlt.data.table import Column, TableSchema
from fedlt.errors import DataError
from fedlt.plan import DataPlan, ModelSection, RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import schema_to_pb
from silo.admission import RefusedRound
from silo.transport import SiloTransport
from tests.consortium_harness import PLAN, write_kit
from tests.test_silo_refusals import RecordingStub, agent_of, check, signed_spec

SCHEMA = TableSchema(
    "outcome",
    (
        Column("age", "numeric", 0.0, 120.0),
        Column("ward", "categorical", categories=("A", "B"), missing=True),
    ),
)
CLASSES = ("no", "yes")
TABLE_PLAN = replace(PLAN, model=ModelSection(name="mlp", classes=CLASSES), data=DataPlan(table=SCHEMA))
CSV = "age,ward,outcome,ssn\n30,A,no,111\n61,,yes,222\n45,B,no,333\n"


def wanted(table=SCHEMA, shape=(3,)) -> Wanted:
    return Wanted(table, ImageSettings(), shape, CLASSES)


def test_a_csv_opens_as_a_table_and_is_encoded_by_the_plans_schema(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text(CSV)
    source = open_source(path)
    assert isinstance(source, TableSource)
    data = source.prepared(TABLE_PLAN.wanted())
    assert TABLE_PLAN.input_shape == (3,)
    assert data.x.shape == (3, 3)
    assert data.y.tolist() == [0, 1, 0]


@pytest.mark.parametrize(
    ("make", "asked", "problem"),
    [
        ("csv", wanted(table=None, shape=(1, 8, 8)), "holds a table, but the plan is a study of images"),
        ("folder", wanted(), "holds images, but the plan is a study of table rows"),
        ("arrays", wanted(), "holds images, but the plan's [data.table] asks for rows of its own schema"),
        ("arrays", wanted(table=None, shape=(1, 16, 16)), "arrays are not resized"),
        ("rows", wanted(table=replace(SCHEMA, label="other")), "rows of another table schema"),
    ],
)
def test_data_of_another_kind_than_the_plan_wants_is_one_line_naming_what_each_side_has(
    tmp_path, make, asked, problem
):
    if make == "csv":
        (tmp_path / "t.csv").write_text(CSV)
        source = open_source(tmp_path / "t.csv")
    elif make == "folder":
        (tmp_path / "f" / "no").mkdir(parents=True)
        Image.new("L", (9, 7)).save(tmp_path / "f" / "no" / "a.png")
        source = open_source(tmp_path / "f")
        assert isinstance(source, ImageSource)
    elif make == "arrays":
        source = ArraySource(LabeledData(np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), CLASSES))
    else:
        source = ArraySource(
            LabeledData(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), CLASSES), SCHEMA
        )
    with pytest.raises(DataError) as refused:
        source.prepared(asked)
    assert problem in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_table_plan_reads_back_as_written_without_an_image_shape():
    text = TABLE_PLAN.to_toml()
    assert "image_shape" not in text
    assert "[data.table.columns.age]" in text
    assert RoundPlan.from_toml(text, "plan") == TABLE_PLAN


def test_a_held_out_slice_takes_every_parts_th_prepared_row(tmp_path):
    (tmp_path / "h.csv").write_text(CSV)
    whole = open_source(tmp_path / "h.csv")
    assert Slice(whole, 1, 2).prepared(TABLE_PLAN.wanted()).y.tolist() == [1]


def test_a_folder_of_mixed_sizes_is_resized_as_the_plan_says(tmp_path):
    for k, size in enumerate([(9, 7), (20, 31), (8, 8)]):
        (tmp_path / "yes").mkdir(exist_ok=True)
        Image.new("L", size, color=255).save(tmp_path / "yes" / f"{k}.png")
    plan = replace(PLAN, model=ModelSection("cnn-small", (1, 8, 8), CLASSES), data=DataPlan())
    with pytest.raises(DataError, match="resize"):
        open_source(tmp_path).prepared(plan.wanted())  # resize "none": sizes must match
    stretched = replace(plan, data=DataPlan(images=ImageSettings(resize="stretch")))
    data = open_source(tmp_path).prepared(stretched.wanted())
    assert data.x.shape == (3, 1, 8, 8)
    assert data.y.tolist() == [1, 1, 1]


# --- at admission: a refusal, told to the aggregator without the reason, the silo's state unchanged -------


@pytest.fixture
def kit(tmp_path):
    return tmp_path, write_kit(tmp_path)


def table_round(root) -> object:
    text = TABLE_PLAN.to_toml()
    method = TABLE_PLAN.build_method()
    schema = schema_to_pb(method.schema(method.init_state(seed=0)))
    return signed_spec(
        root,
        method_config=text,
        schema=schema,
        config_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def use_table(kit, text: str) -> None:
    root, configs = kit
    (root / "train.csv").write_text(text)
    tree = read_toml(configs[0])
    tree["data"] = {"source": "files", "path": str(root / "train.csv")}
    configs[0].write_text(render_toml(tree))


def test_a_table_plan_is_admitted_with_the_silos_csv_encoded_by_its_schema(kit):
    use_table(kit, CSV)
    admitted = check(agent_of(kit), table_round(kit[0]))
    assert admitted.data.input_shape == (3,)
    assert admitted.data.classes == CLASSES


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("ward,outcome\nA,no\n", "has no column 'age' (named in data.table)"),
        ("age,ward,outcome\nold,A,no\n", "train.csv: column 'age', row 2: not a number"),
        ("age,ward,outcome\n30,C,no\n", "column 'ward', row 2: not one of the 2 declared categories"),
        ("age,ward,outcome\n30,A,maybe\n", "label column 'outcome', row 2"),
    ],
)
def test_a_csv_that_does_not_fit_the_schema_is_refused_in_one_line_and_the_silo_keeps_its_state(
    kit, caplog, text, problem
):
    root, _ = kit
    use_table(kit, text)
    agent = agent_of(kit)
    state = agent.state_dir
    before = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    stub = RecordingStub()
    with pytest.raises(RefusedRound) as refused:
        check(agent, table_round(root), stub)
    assert refused.value.code == pb.REFUSAL_CODE_DATA
    assert problem in str(refused.value)
    assert "\n" not in str(refused.value)
    agent.take_round(SiloTransport(stub), table_round(root))
    (told,) = stub.refusals
    assert told.code == pb.REFUSAL_CODE_DATA
    assert "train.csv" not in told.text
    after = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    assert after == before


def test_a_plan_asking_for_images_too_large_to_hold_is_refused_before_any_pixel_is_decoded(kit, monkeypatch):
    """A plan of the aggregator's making with `image_shape = [3, 30000, 30000]` and `resize = "stretch"`:
    each of the silo's images would become 10.8 GB of floats, and preparing them would take the silo's
    process down (out of memory) before any check. The silo sizes the prepared data from the plan and its
    sample count first, and refuses past policy.max_data_mb."""
    root, configs = kit
    for k, size in enumerate([(9, 7), (20, 31)]):
        (root / "images" / "no").mkdir(parents=True, exist_ok=True)
        Image.new("L", size).save(root / "images" / "no" / f"{k}.png")
    tree = read_toml(configs[0])
    tree["data"] = {"source": "files", "path": str(root / "images")}
    configs[0].write_text(render_toml(tree))
    plan = replace(
        PLAN,
        model=ModelSection("cnn-small", (3, 30000, 30000), CLASSES),
        data=DataPlan(images=ImageSettings(resize="stretch")),
    )
    text = plan.to_toml()
    decoded = []
    monkeypatch.setattr(ImageSource, "prepared", lambda self, wanted: decoded.append(wanted))
    signed = signed_spec(root, method_config=text, config_sha256=hashlib.sha256(text.encode()).hexdigest())
    with pytest.raises(RefusedRound, match=r"max_data_mb") as refused:
        check(agent_of(kit), signed)
    assert refused.value.code == pb.REFUSAL_CODE_DATA
    assert decoded == []
