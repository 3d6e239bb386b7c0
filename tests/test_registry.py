"""The registry of privacy layers is the one table: every list of layers derives from it, and every message
each layer's halves make crosses the consortium's real wire forms (a loopback of the service's reading)."""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator import service
from aggregator.config import ConsortiumSection, layer_sections
from attacks.config import Mode
from fedlt.aggregation import layer_names, layers, make_layer, record
from fedlt.aggregation.halves import Released, SumSpec
from fedlt.aggregation.registry import GROUP, LayerRecord
from fedlt.aggregation.schema import Field, Schema
from fedlt.sim.config import SimConfig
from fedlt.wire import PURPOSE_OF_SUM, chunks
from fedlt.wire.codec import BadLayerMessage
from privacy import roundspec, wire
from silo.config import PolicySection
from tests.test_layer_interface import code_nodes
from tests.toy import PLUGINS, toy_installed

SCHEMA = Schema((Field("delta", (7,), 10.0, frac_bits=16), Field("count", (3,), 100.0, frac_bits=0)))
SILOS = ("silo-a", "silo-b", "silo-c")


@pytest.fixture(params=["installed", "with the toy layer"])
def installed(request, monkeypatch) -> Iterator[dict[str, LayerRecord]]:
    """The layers installed here, and again with the toy layer of tests/plugins added."""
    if request.param == "installed":
        yield layers()
    else:
        with toy_installed(monkeypatch):
            yield layers()


def _choices(cls: type, name: str) -> tuple[str, ...]:
    choices = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]
    return tuple(choices() if callable(choices) else choices)


def test_every_table_of_layers_is_the_registry(installed):
    names = tuple(installed)
    assert layer_names() == names
    for name, layer in installed.items():
        assert layer.name == name, "a record and its entry point agree"
        assert layer.layer.name == name, "a record and its sum agree"
    assert layer_sections() == {n: r.settings for n, r in installed.items() if r.settings is not None}
    assert _choices(ConsortiumSection, "privacy") == names
    assert _choices(SimConfig, "privacy") == names
    assert _choices(Mode, "privacy") == names
    assert wire.consortium_layers() == names
    assert not [p for p in PolicySection(privacy=names).problems() if "privacy" in p]
    (refused,) = [p for p in PolicySection(privacy=(*names, "paillier")).problems() if "privacy" in p]
    assert "paillier" in refused


def test_the_service_serves_what_the_registry_carries():
    """Every stage RPC a layer's wire reads has a handler; the service's policy choices are the registry's."""
    for rpc in wire.receivers():
        assert getattr(service.ConsortiumServicer, rpc).__name__ == rpc
    assert service.POLICY_CHOICES["accepted_privacy"] == layer_names()


def test_the_builtin_layers_are_declared_by_entry_points_only():
    """fedlt names no layer package: the built-in layers come through pyproject.toml's entry points."""
    root = Path(__file__).parent.parent
    text = (root / "pyproject.toml").read_text()
    assert f'[project.entry-points."{GROUP}"]' in text
    for path in (root / "fedlt").rglob("*.py"):
        if path.parent.name != "v1":
            assert "privacy." not in _code_of(path), f"{path} names a privacy module"


def _code_of(path: Path) -> str:
    """A module's imports and string literals, less its docstrings."""
    found = []
    for node in code_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return "\n".join(found)


def test_round_parameters_go_through_the_roundspec_and_back(installed):
    for name, layer in installed.items():
        settings = None if layer.settings is None else layer.settings()
        if layer.key_service is not None:
            continue  # its parameters name the consortium's key: tests/test_ckks_consortium.py
        spec = roundspec.build(
            consortium_id="c",
            round_number=1,
            attempt=1,
            round_id="r1.a1.x",
            method="fedavg",
            plan_toml="",
            schema=SCHEMA,
            state_digest="0" * 64,
            state_bytes=1,
            seed=0,
            privacy=name,
            settings=settings,
            participants=SILOS,
            disclosures=(),
            disclosers=(),
            deadline_unix_ms=0,
            census=None,
        )
        assert roundspec.settings_of(spec) == settings, name


class Loopback:
    """A silo's stub whose RPCs land in one aggregator half, read as the service reads them."""

    def __init__(self, silo: str, half, layer: str) -> None:
        self.silo, self.half, self.layer = silo, half, layer

    def __getattr__(self, rpc: str):
        if rpc.startswith("Fetch"):  # a download the step announced

            def fetch(request, timeout=None) -> Iterator:
                for offset, part in chunks(self.half.download(self.silo)):
                    yield type("Part", (), {"offset": offset, "data": part})

            return fetch
        if rpc not in wire.receivers():
            raise AttributeError(rpc)
        return lambda request, timeout=None: self.half.receive(
            self.silo, wire.received(rpc, request, silo=self.silo, credential=b"", layer=self.layer)
        )

    def Submit(self, stream, timeout=None) -> None:  # noqa: N802
        first, *parts = list(stream)
        header = first.header
        limit = self.half.upload_bytes(self.silo, wire.upload_type(header, layer=self.layer))
        assert header.total_bytes <= limit
        payload = b"".join(part.chunk for part in parts)
        self.half.receive(self.silo, wire.submitted(header, payload, layer=self.layer))


def test_every_layers_messages_cross_the_wire_and_sum(installed):
    rng = np.random.default_rng(0)
    for name in installed:
        layer = make_layer(name)
        silo_sides, aggregator_side = layer.in_process(SILOS)
        spec = SumSpec("r1.a1.x", "contribution", SILOS, SCHEMA, binding=b"b" * 32, settings=layer.settings)
        aggregator = aggregator_side.half(spec)
        # on each field's grid: a delta in 1/16 steps, whole counts
        delta = np.round(rng.uniform(-5, 5, (len(SILOS), 7)) * 16) / 16
        count = rng.integers(0, 50, (len(SILOS), 3)).astype(np.float64)
        vectors = {u: torch.from_numpy(np.concatenate([delta[k], count[k]])) for k, u in enumerate(SILOS)}
        halves = {u: silo_sides[u].half(spec, u, may_release=lambda _: None) for u in SILOS}
        stubs = {u: Loopback(u, aggregator, name) for u in SILOS}
        for u, half in halves.items():
            for message in half.start(vectors[u]):
                wire.send(stubs[u], spec.round_id, "contribution", message, timeout=1)
        while not isinstance(out := aggregator.close(), Released):
            for u, step in out.items():
                sent = wire.step_to_pb(spec.round_id, "contribution", step)
                purpose, read = wire.step_from_pb(sent, layer=name)
                assert PURPOSE_OF_SUM[wire.step_to_pb(spec.round_id, purpose, step).sum] == "contribution"
                step = wire.fetched(stubs[u], spec.round_id, purpose, read, timeout=1)
                for message in halves[u].step(step):
                    wire.send(stubs[u], spec.round_id, "contribution", message, timeout=1)
        total = out.total if out.total is not None else halves[SILOS[0]].result
        assert out.survivors == SILOS, name
        expected = sum(vectors.values())
        assert torch.allclose(total, expected, atol=1e-3), name


def test_a_layer_message_of_a_type_no_layer_declared_is_refused(installed):
    from fedlt.v1 import consortium_pb2 as pb
    from fedlt.v1 import layer_pb2

    request = pb.SendRequest(round_id="r", message=layer_pb2.LayerMessage(type="os.system"))
    for name in installed:
        with pytest.raises(BadLayerMessage, match="no layer carries"):
            wire.received("Send", request, silo="silo-a", credential=b"", layer=name)


def test_the_toy_layer_is_only_installed_with_its_entry_point():
    assert str(PLUGINS) not in os.environ.get("PYTHONPATH", "")
    assert "toy" not in layer_names()
    assert record("secagg").layer.name == "secagg"


def test_listing_the_layers_makes_none_of_them(caplog):
    """The aggregator's command line lists the installed layers without making one: making plaintext warns
    that contributions are summed in the clear, which every aggregator start logged whatever its layer."""
    from aggregator.__main__ import main

    with caplog.at_level(logging.WARNING, logger="fedlt.aggregation.plaintext"), pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "in the clear" not in caplog.text
