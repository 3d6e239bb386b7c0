"""One interface, every layer: the conformance suite each privacy layer passes, and the check that nothing
above the layers (round driver, round driver and inbox, service, silo agent) looks at a layer's name."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedlt.aggregation import Field, Schema, layer_names, layers, make_layer
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, Subject
from fedlt.aggregation.halves import PartyKeys, Released, SumAborted, SumSpec
from fedlt.aggregation.registry import record
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.aggregation.sums import run_round
from fedlt.errors import FedltError
from tests.toy import toy_installed

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = Schema(
    (
        Field("delta", (6,), 4.0, frac_bits=20),
        Field("grad", (3, 2), 4.0, frac_bits=20, per_class=True),
        Field("n", (), 100.0, frac_bits=0),
    )
)
SILOS = ("a", "b", "c", "d")


def vectors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for u in SILOS:
        values = {
            f.name: (torch.rand(f.shape, generator=generator, dtype=torch.float64) - 0.5)
            for f in SCHEMA.fields
        }
        values["n"] = torch.tensor(3.0, dtype=torch.float64)
        out[u] = SCHEMA.flatten(values)
    return out


TOY = "toy"  # the toy layer of tests/plugins, installed for its own runs of the suite


@pytest.fixture(params=[*layer_names(), TOY])
def layer(request, monkeypatch):
    if request.param == TOY:
        with toy_installed(monkeypatch):
            yield make_layer(TOY)
    else:
        yield make_layer(request.param)


class PinningLedger(MemoryLedger):
    """Remembers every release the gate let through, by silo."""

    def __init__(self, silo: str, pinned: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.silo, self.pinned = silo, pinned

    def pin_survivors(self, key: str, survivors, what: str) -> None:
        super().pin_survivors(key, survivors, what)
        self.pinned[self.silo] = tuple(survivors)


def silo_rounds(
    silo_sides, sums: RoundSums, given, pinned: dict[str, tuple[str, ...]]
) -> dict[str, SiloRound]:
    return {
        u: SiloRound(
            silo_sides[u],
            sums,
            v,
            me=u,
            gate=ReleaseGate(
                consortium="c", floors=Floors(), members=lambda: SILOS, ledger=PinningLedger(u, pinned)
            ),
            trained_from=Subject("contribution", b"state"),
        )
        for u, v in given.items()
    }


def test_every_layer_sums_exactly_what_the_silos_hold_to_its_precision(layer):
    """And every layer that hides inputs releases each silo's through its gate, before the sum is out."""
    given = vectors()
    sums = RoundSums("r1", SILOS, SCHEMA, k_min=0, census=None, binding=b"b", settings=layer.settings)
    silo_sides, aggregator_side = layer.in_process(SILOS)
    aggregator = AggregatorRound(aggregator_side, sums)
    pinned: dict[str, tuple[str, ...]] = {}
    silos = silo_rounds(silo_sides, sums, given, pinned)
    released = run_round(aggregator, silos)
    hides = next(iter(silos.values())).side.hides_inputs
    assert pinned == (dict.fromkeys(SILOS, SILOS) if hides else {})
    assert isinstance(released, Released)
    assert released.survivors == SILOS
    total = released.total if released.total is not None else silos["a"].result
    truth = sum(given.values())
    assert torch.allclose(total, truth, atol=len(SILOS) * 2.0**-20)


def test_a_sum_left_with_fewer_silos_than_the_round_needs_aborts_before_any_silo_releases(layer):
    """Guards liveness: silos pin the survivor set they release a round's sum for (silo.releases) and never
    sign another, so a sum the aggregator would refuse to commit for too few contributors must end before
    any release: the round's retry over every silo would otherwise be refused forever."""
    given = vectors()
    sums = RoundSums("r1", SILOS, SCHEMA, k_min=0, census=None, binding=b"b", settings=layer.settings)
    silo_sides, aggregator_side = layer.in_process(SILOS)
    aggregator = AggregatorRound(aggregator_side, sums, min_contributors=len(SILOS))
    pinned: dict[str, tuple[str, ...]] = {}
    silos = silo_rounds(silo_sides, sums, given, pinned)
    del silos["d"]  # gone before its first message
    with pytest.raises(SumAborted, match="fewer than"):
        run_round(aggregator, silos)
    assert pinned == {}


def test_every_layer_refuses_a_message_from_a_silo_outside_the_sum(layer):
    silo_sides, aggregator_side = layer.in_process(SILOS)
    spec = SumSpec("r1", "contribution", SILOS[:3], SCHEMA, b"b", layer.settings)
    half = aggregator_side.half(spec)
    (message,) = silo_sides["d"].half(spec, "a", may_release=lambda _: None).start(vectors()["a"])
    with pytest.raises(FedltError):
        half.receive("d", message)


def test_every_layer_names_the_upload_it_takes_and_refuses_others(layer):
    _, aggregator_side = layer.in_process(SILOS)
    half = aggregator_side.half(SumSpec("r1", "contribution", SILOS, SCHEMA, b"b", layer.settings))
    with pytest.raises(SumAborted):
        half.upload_bytes("a", dict)


def test_every_layer_s_silo_half_refuses_a_step_it_does_not_know(layer):
    silo_sides, _ = layer.in_process(SILOS)
    half = silo_sides["a"].half(
        SumSpec("r1", "contribution", SILOS, SCHEMA, b"b", layer.settings), "a", may_release=lambda _: None
    )
    half.start(vectors()["a"])
    with pytest.raises(SumAborted):
        half.step(object())


def test_every_layer_makes_both_consortium_sides_from_party_keys(layer):
    """A silo brings the layer's key where it asks for the key service, the aggregator what the key service
    lets it hold (ckks: the public context; blind: nothing); a silo without the key, or an aggregator handed
    the secret one, is refused clearly."""
    assert layer.describe()
    kind = record(layer.name).key_service
    secret = None if kind is None else kind.new()
    held = None if kind is None else kind.read_public(secret.public_bytes())
    layer.aggregator_side(PartyKeys(secret=held))
    layer.silo_side(PartyKeys(secret=secret))
    if kind is not None:
        with pytest.raises(ValueError, match="only with the consortium's"):
            layer.silo_side(PartyKeys())
        with pytest.raises(ValueError, match="aggregator"):
            layer.aggregator_side(PartyKeys(secret=secret))


# --- nothing above the layers names, imports or tests for a layer ------------------------------------------

# the runtime: every module of the silo agent and the aggregator, and the round driver every layer runs under
ABOVE_THE_LAYERS = sorted(
    str(path.relative_to(ROOT))
    for path in [
        *ROOT.glob("silo/*.py"),
        *ROOT.glob("aggregator/*.py"),
        ROOT / "fedlt/aggregation/round_sums.py",
    ]
)


def layer_packages() -> dict[str, str]:
    """Each installed layer's package (for a layer in a module of fedlt, that module)."""
    packages = {}
    for name, layer in layers().items():
        module = layer.layer.__module__
        packages[name] = ".".join(module.split(".")[:2]) if module.startswith("privacy.") else module
    return packages


def code_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a module, less its docstrings (prose may name a layer as an example)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return (node for node in ast.walk(tree) if id(node) not in docstrings)


@pytest.mark.parametrize("path", ABOVE_THE_LAYERS)
def test_no_code_above_the_layers_names_imports_or_tests_for_a_layer(path):
    text = (ROOT / path).read_text()
    nodes = list(code_nodes(ast.parse(text)))
    packages = layer_packages()
    imported = {
        module
        for node in nodes
        for module in ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        + ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
    }
    wrong = sorted(m for m in imported for p in packages.values() if m == p or m.startswith(p + "."))
    assert not wrong, f"{path} imports a layer's package: {wrong}"
    strings = {node.value for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    named = sorted(strings & set(packages))
    assert not named, f"{path} names the layers {named}: ask the registry for a capability instead"
    layer_classes = {
        cls.__name__
        for layer in layers().values()
        for cls in (layer.layer, *layer.messages)
        if cls is not None
    }
    tested = {
        ast.unparse(node.args[1])
        for node in nodes
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2
    }
    assert not {t for t in tested if any(c in t for c in layer_classes)}, f"{path} tests for a layer's class"
    assert not re.search(r"\.secure\b(?!_channel)", text), f"{path} asks whether a round is secure"


def test_the_guard_covers_every_installed_layer_and_module():
    assert set(layer_packages()) == set(layer_names())
    assert "silo/agent.py" in ABOVE_THE_LAYERS
    assert "aggregator/service.py" in ABOVE_THE_LAYERS
    assert len(ABOVE_THE_LAYERS) > 25
