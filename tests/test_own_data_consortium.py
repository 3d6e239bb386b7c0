"""Issue 34's Done-when: a real consortium (aggregator and silo processes, secagg) on each silo's own files —
CSV tables with a model from an outside package, and image folders of mixed sizes — ends in the very state the
simulator reaches on the same files, bit for bit."""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from aggregator.__main__ import main as aggregator_main
from fedlt.config import render_toml
from fedlt.data.federation import DataConfig, Federation, build_federation
from fedlt.data.images import ImageSettings
from fedlt.data.partition import label_skew
from fedlt.data.source import open_source
from fedlt.data.synthetic_table import write_silo_tables
from fedlt.data.table import TableSchema, read_table
from fedlt.export import ExportError, load_exported
from fedlt.plan import DataPlan, ModelSection
from fedlt.sim.config import ModelChoice, SimConfig
from fedlt.sim.run import run_simulation
from silo.models import pin_line
from tests.consortium_harness import ENV, PLAN, RECIPE, SILO_THREADS, Consortium

NET = '''
from torch import nn


def net(num_classes, input_shape, hidden=16):
    """A bank's own network: any module ending in a linear layer."""
    (features,) = input_shape
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
'''


def simulated(tmp_path: Path, plan, federation: Federation, model: str, *, rounds: int):
    """The simulator on the silos' own files, as prepared for the plan (`federation`)."""
    config = SimConfig(
        seed=0, privacy="secagg", rounds=rounds, data=RECIPE, model=ModelChoice(model), train=plan.train
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(SILO_THREADS)
    try:
        return run_simulation(config, tmp_path / "sim", echo=lambda _: None, federation=federation).state
    finally:
        torch.set_num_threads(threads)


def federation_of(files: list[Path], held_out: Path | None, plan, table: TableSchema | None) -> Federation:
    wanted = plan.wanted()
    silos = [open_source(f).prepared(wanted) for f in files]
    test = open_source(held_out).prepared(wanted) if held_out else silos[0]
    y = np.concatenate([s.y for s in silos])
    parts, start = [], 0
    for s in silos:
        parts.append(np.arange(start, start + len(s)))
        start += len(s)
    counts = np.bincount(y, minlength=len(wanted.classes))
    return Federation(silos, test, counts, label_skew(y, parts), table=table)


def use_files(consortium: Consortium, files: list[Path], policy: dict | None = None) -> None:
    """Each silo trains on its own files instead of the recipe's shard (and pins what `policy` adds)."""
    for config, path in zip(consortium.silo_configs, files, strict=True):
        tree = tomllib.loads(config.read_text())
        tree["data"] = {"source": "files", "path": str(path)}
        tree["policy"].update(policy or {})
        tree.pop("evaluation", None)  # the aggregator evaluates on its own split; the silos only train
        config.write_text(render_toml(tree))


def run(consortium: Consortium) -> object:
    try:
        consortium.start()
        assert consortium.wait_aggregator(timeout=300) == 0
        return consortium.final_state()
    finally:
        consortium.stop()


def assert_same_state(final, expected) -> None:
    assert final.round == expected.round
    assert set(final.model) == set(expected.model)
    assert all(torch.equal(final.model[k], expected.model[k]) for k in expected.model)


def test_csv_tables_with_an_outside_model_under_secagg_match_the_simulator_bit_for_bit(tmp_path, monkeypatch):
    site = tmp_path / "site" / "own_data_models"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "nets.py").write_text(NET)
    monkeypatch.syspath_prepend(str(site.parent))
    monkeypatch.setitem(
        ENV, "PYTHONPATH", os.pathsep.join([str(site.parent), *filter(None, [ENV.get("PYTHONPATH")])])
    )
    files = write_silo_tables(tmp_path / "tables", silos=3, seed=0)
    schema_toml = tomllib.loads((tmp_path / "tables" / "schema.toml").read_text())
    schema = TableSchema.from_table(schema_toml["data"]["table"], "data.table", [])
    classes = tuple(f"class-{c}" for c in range(10))
    entry = "own_data_models.nets:net"
    plan = replace(PLAN, model=ModelSection(name=entry, classes=classes), data=DataPlan(table=schema))
    recipe = DataConfig(dataset="transactions", imbalance=100.0, alpha=0.5, silos=3, test_per_class=30)
    consortium = Consortium.create(tmp_path / "consortium", rounds=2, min_silos=3, plan=plan, recipe=recipe)
    train = [f / "train.csv" for f in files]
    use_files(consortium, train, {"models": [tomllib.loads(f"x = {pin_line(entry)}")["x"]]})
    final = run(consortium)
    expected = simulated(
        tmp_path, plan, federation_of(train, files[0] / "held-out.csv", plan, schema), entry, rounds=2
    )
    assert final.round == 3  # the opening round, then two of training
    assert bool(final.model["encoder.0.ready"])
    assert_same_state(final, expected)
    # exported, the model takes a bank's raw rows encoded by the schema and standardises them itself
    out = tmp_path / "exported"
    assert (
        aggregator_main(
            ["export", "--config", str(consortium.directory / "consortium.toml"), "--out", str(out)]
        )
        == 0
    )
    model, card = load_exported(out)
    assert card["model"]["features"] == list(schema.layout().features)
    rows = torch.from_numpy(read_table(files[0] / "held-out.csv").features(schema))
    simulated_model = plan.build_method().network(0)
    simulated_model.load_state_dict(expected.model)
    simulated_model.eval()
    with torch.no_grad():
        assert torch.equal(model(rows), simulated_model(rows))
    # where the model's package is not installed, loading says so in a line
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(site.parent)])
    for name in ("own_data_models.nets", "own_data_models"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ExportError, match="install its package where you load the model"):
        load_exported(out)


@pytest.mark.slow  # the CSV study above is the default suite's; this one adds the image preparation
def test_image_folders_of_mixed_sizes_under_secagg_match_the_simulator_bit_for_bit(tmp_path):
    shards = build_federation(replace(RECIPE, silos=3), seed=0).silos
    rng = np.random.default_rng(0)
    folders = []
    for k, shard in enumerate(shards):
        folder = tmp_path / "images" / f"silo-{k}"
        for i, (image, label) in enumerate(zip(shard.x, shard.y, strict=True)):
            side = int(rng.integers(8, 20))
            picture = Image.fromarray(np.rint(image[0] * 255).astype(np.uint8)).resize((side, side + k))
            (folder / shard.classes[label]).mkdir(parents=True, exist_ok=True)
            picture.save(folder / shard.classes[label] / f"{i:04d}.{'png' if i % 2 else 'jpg'}")
        folders.append(folder)
    plan = replace(PLAN, data=DataPlan(images=ImageSettings(resize="crop")))
    consortium = Consortium.create(tmp_path / "consortium", rounds=2, min_silos=3, plan=plan)
    use_files(consortium, folders)
    final = run(consortium)
    federation = federation_of(folders, None, plan, None)
    assert_same_state(final, simulated(tmp_path, plan, federation, plan.model.name, rounds=2))
