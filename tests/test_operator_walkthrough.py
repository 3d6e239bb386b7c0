"""docs/operator.md's first study, run as written: its commands, its configuration files, its loader snippet.

The section is the test's script: every `python -m` line of its bash blocks runs (the aggregator and the silo
agents as processes), every ```toml file=PATH block is written where it says, the other two silos' files are
made from St Mary's as the text says, and the Python block loads the export. The only changes are the ones a
test on a shared machine needs: the aggregator listens on a port the system picks, and the silos dial it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlt.data.files import load_dataset
from fedlt.metrics import predict
from tests.consortium_harness import ENV, point_silos_at, wait_for_address

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operator.md"
SECTION = "## A first study, end to end"
SILOS = {"st-marys": "silo-0", "city-clinic": "silo-1", "north-bank": "silo-2"}
BLOCK = re.compile(r"```(\w+)(?: file=(\S+))?\n(.*?)```", re.S)


def walkthrough() -> list[tuple[str, str | None, str]]:
    text = GUIDE.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return BLOCK.findall(text[start:end])


def commands(blocks) -> list[list[str]]:
    return [
        shlex.split(line)
        for kind, _, body in blocks
        if kind == "bash"
        for line in body.splitlines()
        if line.startswith("python -m ")
    ]


def run(study: Path, argv: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=study, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


def write_files(study: Path, blocks) -> None:
    for kind, path, body in blocks:
        if kind == "toml" and path:
            target = study / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
    # the silos dial the port the aggregator gets (`point_silos_at` fills it in)
    template = (study / "st-marys" / "silo.toml").read_text().replace('"127.0.0.1:50051"', '"ADDRESS"')
    (study / "st-marys" / "silo.toml").write_text(template)
    for silo, folder in list(SILOS.items())[1:]:  # "the same but for their own certificate, key and files"
        text = template.replace("st-marys", silo).replace("silo-0/train", f"{folder}/train.npz")
        (study / silo).mkdir(exist_ok=True)
        (study / silo / "silo.toml").write_text(text.replace("silo-0", folder))
    config = study / "consortium.toml"
    config.write_text(config.read_text().replace('listen = "127.0.0.1:50051"', 'listen = "127.0.0.1:0"'))


def start(study: Path, argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv[1:]], cwd=study, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def wait_for_text(log: Path, text: str, aggregator: subprocess.Popen, timeout: float = 180) -> None:
    until = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert aggregator.poll() is None, "the aggregator stopped before every silo registered"
        assert time.monotonic() < until, f"{log.name} has no {text!r} after {timeout} s"
        time.sleep(0.1)


@pytest.mark.slow  # 54 s (10 rounds of 5 epochs, as the guide says), run by `make test-all`
def test_the_first_study_of_the_operator_guide_runs_as_written(tmp_path, monkeypatch):
    study = tmp_path / "study"
    study.mkdir()
    blocks = walkthrough()
    steps = commands(blocks)
    assert [s[2:4] for s in steps if s[3] in ("serve", "run", "status", "export")] == [
        ["aggregator", "serve"],
        *[["silo", "run"]] * 3,
        ["aggregator", "status"],
        ["aggregator", "export"],
    ]
    processes: list[subprocess.Popen] = []
    try:
        for argv in steps:
            command = argv[2:4]
            if command[0] == "silo" and not (study / "st-marys" / "silo.toml").exists():
                write_files(study, blocks)  # the silos write theirs once the operator's steps are done
            if command == ["aggregator", "serve"]:
                aggregator = start(study, argv, tmp_path / "aggregator.log")
                processes.append(aggregator)
                address = wait_for_address(study / "aggregator-data", aggregator, timeout=120)
                point_silos_at(address, [study / silo / "silo.toml" for silo in SILOS])
            elif command == ["silo", "run"]:
                processes.append(start(study, argv, tmp_path / f"{Path(argv[-1]).parent.name}.log"))
            elif command == ["aggregator", "status"]:
                for silo in SILOS:
                    wait_for_text(tmp_path / f"{silo}.log", "registered as", aggregator)
                assert "st-marys" in run(study, argv)
                assert aggregator.wait(timeout=600) == 0, (tmp_path / "aggregator.log").read_text()
            elif command == ["silo", "roster"]:
                assert "(this silo)" in run(study, argv)
            else:
                run(study, argv)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    (snippet,) = [body for kind, _, body in blocks if kind == "python"]
    scope: dict = {}
    monkeypatch.chdir(study)  # the snippet names the export folder relative to the study
    exec(snippet, scope)
    model, card = scope["model"], scope["card"]
    classes = card["model"]["classes"]
    assert classes[:3] == ["zero", "one", "two"]
    # the card's accuracy is the silos' summed held-out counts: the exported model scores the same on the
    # union of the held-out files, each mapped into the plan's label space by name
    held_out = [
        load_dataset(study / "data" / folder / "held-out.npz").in_label_space(tuple(classes))
        for folder in SILOS.values()
    ]
    x = np.concatenate([h.x for h in held_out])
    y = np.concatenate([h.y for h in held_out])
    with torch.no_grad():
        correct = int((predict(model, x) == y).sum())
    assert card["evaluation"]["accuracy"] == correct / len(y)
    assert set(card["evaluation"]["per_class"]) == set(classes)
    assert all(card["evaluation"][group] is not None for group in ("many", "few"))
    assert card["rounds"]["committed"] == card["rounds"]["planned"] + 1  # the recipe's priors round
