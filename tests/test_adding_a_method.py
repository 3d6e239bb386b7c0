"""docs/adding-a-method.md followed as written: its FedAvgM module, its table line, its configuration and its
commands.

The module is taken from the page's code block, written to a temporary folder, imported and put in the method
table for the test only; then the page's `python -m fedlt.sim` commands run in this process (a subprocess
would not see the registration) in a folder holding the page's configuration file.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fedlt.aggregation import Schema, Sums
from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.config import parse_section
from fedlt.methods import METHODS, ModelSpec, ServerContext, TrainConfig
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.state import GlobalState, flatten, float_keys
from fedlt.sim.__main__ import main as simulate
from silo.config import PolicySection

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding-a-method.md"
BLOCK = re.compile(r"```(\w+)(?: file=(\S+))?\n(.*?)```", re.S)
TABLE_LINE = re.compile(r"m\.name: m for m in \(([^)]*)\)")
CLASSES = 10  # digits: chance is 1 in 10
SPEC = ModelSpec("cnn-small", (1, 8, 8), CLASSES)


def blocks() -> list[tuple[str, str, str]]:
    return BLOCK.findall(PAGE.read_text())


def block(path: str) -> str:
    """The page's one block written to `path`."""
    (body,) = [body for _, name, body in blocks() if name == path]
    return body


def shown(kind: str) -> str:
    """The page's one block of `kind` (the error it shows is its only `text` block)."""
    (body,) = [body for k, _, body in blocks() if k == kind]
    return body


@pytest.fixture
def fedavgm(tmp_path, monkeypatch) -> ModuleType:
    """The page's module, imported from where the test wrote it and registered for this test only."""
    source = tmp_path / "module" / "fedavgm.py"
    source.parent.mkdir()
    source.write_text(block("fedlt/methods/fedavgm.py"))
    spec = importlib.util.spec_from_file_location("fedavgm_from_the_page", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # the options' type hints resolve through it
    spec.loader.exec_module(module)
    monkeypatch.setitem(METHODS, module.FedAvgM.name, module.FedAvgM)
    return module


@pytest.fixture
def cli():
    """The simulator's `main`, which configures the root logger as a command should (`force=True`); the
    test process gets its handlers and level back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield simulate
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def one_thread():
    """Local training on a shared machine: one torch thread keeps it from oversubscribing the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_pages_table_line_is_the_tables_with_the_new_method():
    page = TABLE_LINE.search(PAGE.read_text())
    table = TABLE_LINE.search((ROOT / "fedlt" / "methods" / "choice.py").read_text())
    assert table, "fedlt/methods/choice.py no longer has the table line the page shows"
    assert page, "docs/adding-a-method.md no longer shows the table line"
    names = [n.strip() for n in table.group(1).split(",") if n.strip()]
    assert [n.strip() for n in page.group(1).split(",")] == [*names, "FedAvgM"], (
        "docs/adding-a-method.md shows another method table than fedlt/methods/choice.py's: update the page"
    )


def test_the_pages_module_passes_the_projects_lint(tmp_path):
    """Newcomers copy it: it keeps the rules every module of fedlt keeps."""
    source = tmp_path / "fedavgm.py"
    source.write_text(block("fedlt/methods/fedavgm.py"))
    config = ["--config", str(ROOT / "pyproject.toml")]
    for check in (["check", *config, str(source)], ["format", "--diff", *config, str(source)]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *check], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_pages_excerpt_of_fedavgs_fields_is_fedavgs_code():
    (excerpt,) = [body for kind, name, body in blocks() if kind == "python" and 'Field("delta"' in body]
    code = (ROOT / "fedlt" / "methods" / "fedavg.py").read_text()
    assert re.sub(r"\s", "", excerpt) in re.sub(r"\s", "", code), (
        "update the page's excerpt of FedAvg's fields"
    )


def test_the_pages_method_runs_in_the_simulator_as_written(
    fedavgm, cli, tmp_path, monkeypatch, capsys, one_thread
):
    monkeypatch.chdir(tmp_path)
    Path("fedavgm.toml").write_text(block("fedavgm.toml"))
    commands = [
        shlex.split(line)
        for kind, _, body in blocks()
        if kind == "bash"
        for line in body.splitlines()
        if line.startswith("python -m fedlt.sim")
    ]
    layers = [argv[argv.index("--privacy") + 1] for argv in commands]
    assert layers == ["plaintext", "secagg"]
    for argv in commands:
        assert cli(argv[3:]) == 0, capsys.readouterr().err
        out = Path(argv[argv.index("--out") + 1])
        assert (
            tomllib.loads((out / "config.toml").read_text())["privacy"] == argv[argv.index("--privacy") + 1]
        )
        rounds = json.loads((out / "metrics.json").read_text())["rounds"]
        assert [r["round"] for r in rounds] == [1, 2]
        assert rounds[-1]["accuracy"] > 1 / CLASSES + 0.05, rounds
        saved = torch.load(out / "checkpoint.pt", weights_only=True)
        tensors = [*saved["model"].values(), *saved["extra"].values()]
        assert all(bool(torch.isfinite(t.double()).all()) for t in tensors)
        velocity = saved["extra"][fedavgm.VELOCITY]
        keys = float_keys(saved["model"])
        assert velocity.shape == flatten(saved["model"], keys).shape
        assert velocity.abs().max() > 0


def test_a_setting_outside_its_limits_stops_the_run_with_the_pages_message(
    fedavgm, cli, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    Path("fedavgm.toml").write_text(block("fedavgm.toml").replace("momentum = 0.9", "momentum = 1.0"))
    assert cli(["--config", "fedavgm.toml", "--out", "runs/refused"]) == 2
    assert shown("text").strip() in capsys.readouterr().err
    assert not Path("runs/refused").exists()


def test_the_server_half_takes_only_sums(fedavgm):
    """The keystone: neither a plain mapping nor one dressed as sums reaches the server half, and no caller
    makes `Sums` but a privacy layer."""
    method = fedavgm.FedAvgM(options=fedavgm.FedAvgMOptions(), train=TrainConfig(), model=SPEC, rounds=2)
    state = method.init_state(seed=0)
    schema = method.schema(state)
    values = {"delta": torch.zeros(schema.fields[0].shape), "n": torch.tensor(4.0)}

    class LooksLikeSums(dict):
        """A mapping dressed as a layer's sums."""

        def __init__(self) -> None:
            super().__init__(values)
            self.schema, self.contributors = schema, 3

    for forged in (values, LooksLikeSums()):
        with pytest.raises(TypeError, match="takes Sums from a privacy layer"):
            method.server_step(state, forged, ServerContext(1, 0))
    with pytest.raises(TypeError, match="made only by a privacy layer"):
        Sums(schema, schema.flatten(values), 3)


def _step(method, state: GlobalState, changes: list[torch.Tensor], samples: list[int]) -> GlobalState:
    """A round whose silos changed the model by `changes` and hold `samples`, summed in the clear."""
    schema: Schema = method.schema(state)
    scale = method.weight_scale(state)
    contributions = [
        schema.contribution(delta=n / scale * d, n=float(n)) for d, n in zip(changes, samples, strict=True)
    ]
    return method.server_step(state, PlaintextSum().aggregate(schema, contributions), ServerContext(1, 0))


def test_momentum_zero_is_fedavg_and_momentum_adds_the_last_velocity(fedavgm):
    """The module's docstring: β = 0 gives FedAvg's model; else w ← w + v with v ← β·v + Δ̄."""
    train = TrainConfig()
    plain = FedAvg(options=FedAvgOptions(), train=train, model=SPEC, rounds=2)
    still = fedavgm.FedAvgM(options=fedavgm.FedAvgMOptions(momentum=0.0), train=train, model=SPEC, rounds=2)
    moving = fedavgm.FedAvgM(options=fedavgm.FedAvgMOptions(momentum=0.5), train=train, model=SPEC, rounds=2)
    start = plain.init_state(seed=0)
    keys = float_keys(start.model)
    size = flatten(start.model, keys).numel()
    first = [
        torch.full((size,), 0.01, dtype=torch.float64),
        torch.linspace(-0.02, 0.02, size, dtype=torch.float64),
    ]
    second = [
        torch.linspace(0.03, -0.01, size, dtype=torch.float64),
        torch.full((size,), -0.005, dtype=torch.float64),
    ]
    samples = [30, 10]
    states = {}
    for name, method in (("plain", plain), ("still", still), ("moving", moving)):
        states[name] = _step(method, _step(method, start, first, samples), second, samples)
    assert all(torch.equal(states["plain"].model[k], states["still"].model[k]) for k in start.model)

    def mean(changes: list[torch.Tensor]) -> torch.Tensor:
        return sum(n * d for d, n in zip(changes, samples, strict=True)) / sum(samples)

    velocity = 0.5 * mean(first) + mean(second)
    expected = flatten(start.model, keys).double() + mean(first) + velocity
    assert torch.allclose(flatten(states["moving"].model, keys).double(), expected, atol=1e-6)
    assert torch.allclose(states["moving"].extra[fedavgm.VELOCITY].double(), velocity, atol=1e-6)


def test_the_pages_silo_policy_accepts_the_method_only_once_it_is_installed(fedavgm, monkeypatch):
    table = tomllib.loads(block("silo-policy.toml"))["policy"]
    problems: list[str] = []
    policy = parse_section(PolicySection, table, "policy", problems)
    assert problems + policy.problems() == []
    assert "fedavgm" in policy.methods
    monkeypatch.delitem(METHODS, "fedavgm")
    assert any("unknown ['fedavgm']" in p for p in policy.problems())
