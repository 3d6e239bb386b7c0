"""docs/bring-your-own.md, run as written: the page is this test's script.

Its tagged blocks (the comment at the top of the page lists the tags) are the bank's study: the model package
and the other files are written where the page says, each `step` command runs in the study folder in page
order with its printed `output` compared, the aggregator and the silo agents run as processes, the model is
exported and scored with the page's script. What a test on a shared machine changes: the kit comes from
tests/consortium_harness.py (the page's `kit` lines are checked to be operator.md's, which
tests/test_operator_walkthrough.py runs), and with it the `[consortium]`, `[server]` and `[timeouts]`
sections (1 round, short timeouts, port 0, which the silos dial); the model package reaches the processes
through PYTHONPATH rather than their working folder; each silo trains on one thread. The image and DICOM
blocks are parsed and prepare files the test writes; the error lines are checked against the messages the
code gives today for the mistakes the page describes; the simulator command is checked by its own parser
(and run, marked slow).
"""

from __future__ import annotations

import csv
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedlt.sim.__main__ as sim_main
from aggregator.config import load_consortium_config
from fedlt.config import render_toml
from fedlt.data.source import open_source
from fedlt.data.synthetic_table import write_silo_tables
from fedlt.data.table import TableSchema
from fedlt.errors import ConfigError, DataError
from fedlt.export import load_exported
from fedlt.plan import RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from silo.admission import TOLD
from silo.config import load_silo_config
from silo.models import model_refusals
from tests import test_operator_walkthrough as walkthrough
from tests.consortium_harness import ENV, SILO_THREADS, Consortium
from tests.test_dicom import _write as write_ct

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "bring-your-own.md"
BLOCK = re.compile(r"^```(\w+)[ \t]*(\S*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
TAGS = ("file", "part", "step", "output", "kit", "check", "plan", "silo", "log")
ROUNDS = 1
# the sections the page's consortium.toml gives, in place of the harness's
PLAN_SECTIONS = ("model", "train", "method", "selection", "dp", "data", "evaluation")
ADDRESS = '"127.0.0.1:50051"'  # the aggregator in the page's silo.toml; the test's dials the port it got


@dataclass(frozen=True)
class Block:
    language: str
    tag: str
    value: str
    body: str


def page() -> list[Block]:
    found = []
    for language, info, body in BLOCK.findall(GUIDE.read_text()):
        tag, _, value = info.partition("=")
        assert tag in ("", *TAGS), f"a block tagged {info!r}: not one of the page's tags {TAGS}"
        found.append(Block(language, tag, value, body))
    return found


def tagged(blocks: list[Block], tag: str) -> list[Block]:
    return [b for b in blocks if b.tag == tag]


def named(blocks: list[Block], tag: str, value: str) -> Block:
    (block,) = [b for b in blocks if b.tag == tag and b.value == value]
    return block


def lines(block: Block) -> list[list[str]]:
    return [shlex.split(line) for line in block.body.splitlines() if line.strip()]


def consortium_parts(blocks: list[Block]) -> str:
    return "\n".join(b.body for b in tagged(blocks, "part") if b.value == "consortium.toml")


def the_plan(blocks: list[Block]) -> RoundPlan:
    """The plan the page's parts of consortium.toml make (with its `[evaluation]`, which a plan signs)."""
    return RoundPlan.from_toml(consortium_parts(blocks), "the page's consortium.toml")


def write_files(study: Path, blocks: list[Block]) -> None:
    for block in tagged(blocks, "file"):
        (study / block.value).parent.mkdir(parents=True, exist_ok=True)
        (study / block.value).write_text(block.body)


def run(study: Path, argv: list[str]) -> str:
    assert argv[0] == "python", f"the page's commands run python, got {shlex.join(argv)}"
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=study, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


# --- the bank's study -------------------------------------------------------------------------------


def silo_names(blocks: list[Block]) -> list[str]:
    """The silos' ids in the page's kit, in order (each has its folder and its certificate under them)."""
    return [
        argv[argv.index("--silo-id") + 1] for argv in lines(named(blocks, "kit", "")) if "--silo-id" in argv
    ]


def consortium_toml(study: Path, blocks: list[Block]) -> None:
    """The harness's consortium.toml without its plan, then the page's parts, as written."""
    path = study / "consortium.toml"
    tree = tomllib.loads(path.read_text())
    kept = {k: v for k, v in tree.items() if k not in PLAN_SECTIONS}
    path.write_text(f"{render_toml(kept)}\n{consortium_parts(blocks)}")


def silo_tomls(study: Path, blocks: list[Block]) -> list[Path]:
    """Bank A's silo.toml as the page writes it, the others 'the same but for their certificate and key and
    their files'; each kit from the harness's, copied to where the page's silo.toml looks for it."""
    names = silo_names(blocks)
    first = (study / names[0] / "silo.toml").read_text()
    assert ADDRESS in first
    configs = []
    (study / "pki" / "outbox").mkdir()
    for k, name in enumerate(names):
        for suffix in ("pem", "key"):
            shutil.copy2(study / "pki" / f"silo-{k}.{suffix}", study / "pki" / "outbox" / f"{name}.{suffix}")
        text = first.replace(names[0], name).replace("silo-0", f"silo-{k}").replace(ADDRESS, '"ADDRESS"')
        path = study / name / "silo.toml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"{text}\n[compute]\nthreads = {SILO_THREADS}\n")
        configs.append(path)
    return configs


def serve(study: Path, blocks: list[Block]) -> Consortium:
    """The harness's kit and consortium, then the page's plan and silo.toml files, and the aggregator."""
    consortium = Consortium.create(study, rounds=ROUNDS, min_silos=3)
    consortium_toml(study, blocks)
    consortium.silo_configs = silo_tomls(study, blocks)
    consortium.start_aggregator()
    return consortium


def finished(consortium: Consortium, timeout: float = 300) -> None:
    """Until the aggregator has run the study and exited; a silo refusing a round (a page whose plan its
    files or its pin do not fit) fails the test at once, with the silo's line."""
    assert consortium.aggregator is not None
    until = time.monotonic() + timeout
    while consortium.aggregator.poll() is None:
        for k in range(len(consortium.silo_configs)):
            log = consortium.directory / f"silo-{k}.log"
            refusals = [line for line in log.read_text().splitlines() if "refusing a round" in line]
            assert not refusals, refusals[0]
        assert time.monotonic() < until, "the study did not end:\n" + "\n".join(consortium.output)
        time.sleep(0.2)
    assert consortium.aggregator.returncode == 0, "\n".join(consortium.output)


def test_the_bank_study_runs_as_written(tmp_path, monkeypatch):
    study = tmp_path / "study"
    study.mkdir()
    blocks = page()
    write_files(study, blocks)
    monkeypatch.setitem(ENV, "PYTHONPATH", os.pathsep.join(filter(None, [str(study), ENV.get("PYTHONPATH")])))
    consortium: Consortium | None = None
    printed, commands = "", []
    try:
        for block in blocks:
            if block.tag == "output":
                assert printed == block.body, f"the page says the step prints\n{block.body}got\n{printed}"
            if block.tag != "step":
                continue
            printed = ""
            for argv in lines(block):
                commands.append(argv[1:4])
                if argv[1:4] == ["-m", "aggregator", "serve"]:
                    consortium = serve(study, blocks)
                elif argv[1:4] == ["-m", "silo", "run"]:
                    assert consortium is not None, "a silo starts after the aggregator"
                    consortium.start_silo(consortium.silo_configs.index(study / argv[-1]))
                else:
                    if argv[1:4] == ["-m", "aggregator", "export"]:
                        assert consortium is not None
                        finished(consortium)
                        final = consortium.final_state()
                        assert final.round == ROUNDS + 1  # the opening round, then the training rounds
                        assert bool(final.model["encoder.0.ready"])
                    printed += run(study, argv)
    finally:
        if consortium is not None:
            consortium.stop()
    assert commands == [
        ["-m", "silo", "models"],
        ["-m", "fedlt.data.synthetic_table", "--out"],
        ["-m", "aggregator", "serve"],
        *[["-m", "silo", "run"]] * 3,
        ["-m", "aggregator", "export"],
        ["predict.py"],
    ]
    (pin,) = [b.body.strip() for b in tagged(blocks, "output") if "sha256" in b.body]
    written = tomllib.loads((study / "data" / "schema.toml").read_text())["data"]["table"]
    assert the_plan(blocks).data.table == TableSchema.from_table(written, "data.table", [])  # 'the same'
    assert pin in (study / "bank-a" / "silo.toml").read_text()
    monkeypatch.syspath_prepend(str(study))  # the card's plan names the page's package
    try:
        _, card = load_exported(study / "model")
    finally:  # imported here: other tests' packages of the same name must not find this one
        for name in [m for m in sys.modules if m.partition(".")[0] == "bank_models"]:
            del sys.modules[name]
    assert card["model"]["name"] == "bank_models.nets:fraud_net"
    assert f"held-out accuracy: {card['evaluation']['accuracy']:.1%}" in printed


def test_the_kit_commands_are_the_operator_guides_with_this_studys_names():
    ours = lines(named(page(), "kit", ""))
    kit = (["aggregator", "ca"], ["aggregator", "roster"])
    theirs = [argv for argv in walkthrough.commands(walkthrough.walkthrough()) if argv[2:4] in kit]
    names = {}
    for mine, operators in zip(ours, theirs, strict=True):
        for key in ("--silo-id", "--consortium", "--name"):
            if key in mine and key in operators:
                names[mine[mine.index(key) + 1]] = operators[operators.index(key) + 1]
    assert len(names) == 6  # the CA's name, three silos, the consortium and the operator's certificate
    renamed = "\n".join(map(shlex.join, ours))
    for mine, operators in names.items():
        renamed = renamed.replace(mine, operators)
    assert renamed == "\n".join(map(shlex.join, theirs))


# --- images and DICOM -------------------------------------------------------------------------------


def write_images(folder: Path, classes: tuple[str, ...]) -> None:
    """Two images a class, of different sizes and modes, PNG and JPEG."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (folder / name).mkdir(parents=True)
        for i, (width, height, mode) in enumerate(((90, 40, "L"), (33, 71, "RGB"))):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            image = Image.fromarray(pixels).convert(mode)
            image.save(folder / name / f"{c}-{i}.{'png' if i else 'jpg'}")


def write_dicom(folder: Path, labels: Path, classes: tuple[str, ...]) -> None:
    """One CT slice a class, of different sizes, and the labels file the silo.toml names."""
    rows = []
    for c, name in enumerate(classes):
        side = 40 + 9 * c
        write_ct(
            folder / f"scan-{c}.dcm", np.arange(side * (side + 3), dtype=np.int16).reshape(side, side + 3)
        )
        rows.append([f"scan-{c}.dcm", name])
    labels.parent.mkdir(parents=True, exist_ok=True)
    with labels.open("w", newline="") as handle:
        csv.writer(handle).writerows([["file", "label"], *rows])


@pytest.mark.parametrize("name", ["xray", "ct"])
def test_the_image_and_dicom_sections_prepare_files_of_any_size(tmp_path, name):
    blocks = page()
    plan = RoundPlan.from_toml(named(blocks, "plan", name).body, f"plan={name}")
    (tmp_path / "silo.toml").write_text(named(blocks, "silo", name).body)
    config = load_silo_config(tmp_path / "silo.toml")
    classes = plan.model.classes
    if config.data.format == "dicom":
        write_dicom(config.path(config.data.path), config.path(config.data.labels), classes)
    else:
        write_images(config.path(config.data.path), classes)
        write_images(config.path(config.evaluation.path), classes)
    prepared = [config.load_data().prepared(plan.wanted())]
    if config.evaluation.path:
        prepared.append(config.load_evaluation().prepared(plan.wanted()))
    for data in prepared:
        assert data.x.shape[1:] == plan.model.image_shape
        assert data.classes == classes
        assert sorted(set(data.y.tolist())) == list(range(len(classes)))
        assert data.x.min() >= 0.0
        assert data.x.max() <= 1.0


# --- the error lines --------------------------------------------------------------------------------


def logged(block: Block, who: str) -> str:
    """The message of the block's line that `who` (silo, aggregator) logged."""
    (line,) = [line for line in block.body.splitlines() if line.split(" ", 3)[2:3] == [who]]
    return line.split(" ", 3)[3]


def test_the_schema_error_is_what_the_aggregator_prints(tmp_path, monkeypatch):
    """'age lost its max and region's kind was misspelt'."""
    blocks = page()
    tree = tomllib.loads(consortium_parts(blocks))
    columns = tree["data"]["table"]["columns"]
    del columns["age"]["max"]
    columns["region"]["kind"] = "category"
    monkeypatch.chdir(tmp_path)
    Path("consortium.toml").write_text(render_toml(tree))
    with pytest.raises(ConfigError) as refused:
        load_consortium_config("consortium.toml")
    command, *shown = named(blocks, "log", "schema").body.splitlines()
    assert command == "$ python -m aggregator serve --config consortium.toml"
    assert "\n".join(shown) == f"error: {refused.value}"


def test_the_data_error_is_what_the_silo_logs(tmp_path):
    """Bank C's train.csv 'with an age of 130 on line 6, n/a for a balance on line 10 and a region centre on
    line 13'."""
    blocks = page()
    plan = the_plan(blocks)
    folder = write_silo_tables(tmp_path / "data", silos=3, seed=0)[2]
    path = folder / "train.csv"
    rows = list(csv.reader(path.open(newline="")))
    for line, column, value in ((6, "age", "130"), (10, "balance", "n/a"), (13, "region", "centre")):
        rows[line - 1][rows[0].index(column)] = value
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    with pytest.raises(DataError) as refused:
        open_source(path).prepared(plan.wanted())
    block = named(blocks, "log", "data")
    assert logged(block, "silo").endswith(f"data/silo-2/train.csv: {refused.value.reason}")
    assert f"(data): {TOLD[pb.REFUSAL_CODE_DATA]};" in logged(block, "aggregator")


def test_the_model_refusal_is_what_the_silo_logs():
    block = named(page(), "log", "model")
    (refusal,) = model_refusals("bank_models.nets:fraud_net", {})
    assert logged(block, "silo").endswith(f": {refusal}")
    assert f"(policy): {refusal};" in logged(block, "aggregator")


# --- the simulator -----------------------------------------------------------------------------------


def simulator_command() -> list[str]:
    (argv,) = lines(named(page(), "check", ""))
    assert argv[:3] == ["python", "-m", "fedlt.sim"]
    return argv


def test_the_simulator_command_is_accepted(monkeypatch):
    """Its flags parse and make a valid configuration; the run itself is the slow test's."""
    configs = []
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)  # main's would replace pytest's handlers
    monkeypatch.setattr(sim_main, "_run", lambda config, out, quiet: configs.append(config) or 0)
    assert sim_main.main(simulator_command()[3:]) == 0
    (config,) = configs
    assert (config.data.dataset, config.privacy) == ("transactions", "secagg")
    assert config.model.name == the_plan(page()).model.name


@pytest.mark.slow
def test_the_simulator_command_runs(tmp_path):
    """In a study folder holding the page's model package, which the command names."""
    write_files(tmp_path, page())
    assert "final test accuracy" in run(tmp_path, simulator_command())
