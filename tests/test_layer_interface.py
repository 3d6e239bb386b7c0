"""One interface, every layer: the conformance suite each privacy layer passes, and the check that nothing
above the layers (round driver, round engine, service, silo agent) looks at a layer's name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from fedlt.aggregation import LAYERS, Field, Schema, make_layer
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, Subject
from fedlt.aggregation.halves import PartyKeys, Released, SumAborted, SumSpec
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.aggregation.sums import run_round
from fedlt.errors import FedltError
from privacy.ckks.keys import SecretContext

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


@pytest.fixture(params=sorted(LAYERS))
def layer(request):
    return make_layer(request.param)


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
    """A silo brings its secret context to CKKS, the aggregator the public one; without, a clear refusal."""
    assert layer.describe()
    secret = SecretContext.new()
    silo_keys, aggregator_keys = PartyKeys(secret=secret), PartyKeys(secret=secret.public)
    layer.aggregator_side(aggregator_keys)
    layer.silo_side(silo_keys)
    if layer.name == "ckks":
        with pytest.raises(ValueError, match="secret context"):
            layer.silo_side(PartyKeys())
        with pytest.raises(ValueError, match="public context"):
            layer.aggregator_side(silo_keys)


# --- nothing above the layers looks at a layer's name ----------------------------------------------------

ABOVE_THE_LAYERS = [
    "fedlt/aggregation/round_sums.py",
    "fedlt/aggregation/sums.py",
    "aggregator/rounds.py",
    "aggregator/held_state.py",
    "aggregator/evaluation.py",
    "aggregator/evaluation_sum.py",
    "aggregator/sessions.py",
    "aggregator/service.py",
    "silo/agent.py",
    "silo/participation.py",
]
LAYER_NAME = re.compile(r"""["'](plaintext|secagg|ckks)["']""")


@pytest.mark.parametrize("path", ABOVE_THE_LAYERS)
def test_no_code_above_the_layers_branches_on_a_layer_or_imports_one(path):
    text = (ROOT / path).read_text()
    tree = ast.parse(text)
    code = "\n".join(
        ast.get_source_segment(text, node) or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare | ast.If | ast.Match)
    )
    assert not LAYER_NAME.search(code), f"{path} compares against a layer's name"
    assert not re.search(r"\.secure\b(?!_channel)", text), f"{path} asks whether a round is secure"
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("privacy.secagg")
    }
    allowed = {"privacy.secagg.peers"} if path == "silo/agent.py" else set()  # the silo's peers check
    assert imported <= allowed, f"{path} imports {sorted(imported - allowed)}"
