"""The proof that a privacy layer is one package and one registry line: the toy layer in tests/plugins (a
package and the entry-point line of its dist-info) runs through the simulator and a real consortium, with no
edit in `silo/`, `aggregator/` or `fedlt/` (docs/adding-a-layer.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from fedlt.aggregation import layer_names, make_layer, record
from privacy import wire
from tests.consortium_harness import Consortium
from tests.test_consortium import assert_same_model, simulated_state
from tests.toy import toy_installed

PLUGINS = Path(__file__).parent / "plugins"
ROOT = Path(__file__).parent.parent
OUTSIDE = ("silo", "aggregator", "fedlt", "privacy", "pyproject.toml")  # where a new layer needs no edit


@pytest.fixture
def toy(monkeypatch):
    with toy_installed(monkeypatch):
        yield record("toy")


def test_a_layer_is_found_by_its_entry_point_and_named_nowhere_else(toy):
    assert "toy" in layer_names()
    assert toy.layer.name == "toy"
    assert toy.messages
    assert not toy.wire.senders
    tracked = subprocess.run(
        ["git", "grep", "--untracked", "-l", "-i", "-w", "-e", "toy", "--", *OUTSIDE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert tracked.stdout == "", "the toy layer is named outside its own package"


def test_without_its_entry_point_the_layer_is_unknown():
    assert "toy" not in layer_names()


def test_the_toy_layer_sums_in_the_simulator_as_secure_aggregation_does(toy, tmp_path):
    """Both encode each field on its fixed-point grid and add exactly: the same model, to the bit."""
    via_toy = simulated_state(tmp_path / "toy", rounds=2, privacy="toy")
    via_secagg = simulated_state(tmp_path / "secagg", rounds=2, privacy="secagg")
    assert_same_model(via_toy, via_secagg, atol=0)


def test_the_toy_layers_messages_cross_the_generic_wire(toy):
    layer = make_layer("toy")
    names = layer_names()
    assert names == tuple(sorted(names))
    shares = toy.messages[0]({"silo-1": b"\x01" * 8})
    kind, payload = wire.payload_of(shares)
    assert wire.upload_of(kind, payload, layer="toy") == shares
    assert layer.describe().startswith("toy")


def test_a_real_consortium_runs_the_toy_layer_to_the_simulators_model(toy, tmp_path):
    consortium = Consortium.create(tmp_path / "c", rounds=2, min_silos=3, privacy="toy")
    try:
        consortium.start()
        assert consortium.wait_aggregator(timeout=240) == 0, "\n".join(consortium.output[-30:])
        final = consortium.final_state()
    finally:
        consortium.stop()
    assert_same_model(final, simulated_state(tmp_path, rounds=2, privacy="toy"), atol=0)
    assert torch.isfinite(final.model[next(iter(final.model))]).all()
