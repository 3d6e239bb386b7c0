"""A hostile aggregator against the silo agent's parsers: signed RoundSpecs, directives, states, sum steps.

The aggregator holds the key that signs RoundSpecs, so it can sign any bytes, and make every claim agree with
every other (a state's digest with the signed one, a plan's hash with the plan). The agent acts on what it is
sent in `SiloAgent.follow`, where a refusal the agent knows (RefusedRound, PkiError, the FedltErrors of a
sum, a gRPC error that makes it reconnect) is logged and the agent goes on; any other exception
(AttributeError, KeyError, struct.error, a RuntimeError from torch) ends the agent, which is what a hostile
aggregator must not be able to do. Inputs are generated from the messages' descriptors (`messages`), as raw
bytes, and as mutations of the well-formed RoundSpec and state of a real first round.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.errors import FedltError
from fedlt.methods.state import GlobalState, pack_state, unpack_state
from fedlt.plan import RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy import roundspec
from privacy.pki.errors import PkiError
from privacy.pki.signing import ROUNDSPEC_CONTEXT, load_private_key, sign
from silo.admission import RefusedRound
from silo.agent import SiloAgent
from silo.participation import Participation
from silo.transport import SiloTransport
from tests.consortium_harness import PLAN, write_kit
from tests.test_fuzz_rpc import (
    FUZZ,
    SLOW_FUZZ_EXAMPLES,
    Made,
    Recipe,
    build,
    encoded,
    messages,
    mutated,
    raw_messages,
)
from tests.test_silo_refusals import SILOS, agent_of, signed_spec

STATE = PLAN.build_method().init_state(seed=0)
PACKED = pack_state(STATE)
SIZE = PLAN.build_method().schema(STATE).size  # of a contribution, in float64 values
BIGGEST = torch.finfo(torch.float32).max  # finite weights that training takes to infinity
SLOW_STATES = 1_000  # a state that passes the checks is trained on: about half a second an input


class Unreachable(grpc.RpcError):
    """What every call of a stub that answers nothing raises: the agent reconnects on it."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the test's aggregator answers nothing"


class Stub:
    """The aggregator's side of the calls a silo makes: `states` answers FetchState, every send is taken
    (and remembered, in `sent`), anything else is Unreachable."""

    def __init__(self, states: list[pb.FetchStateResponse] | None = None) -> None:
        self.states = states
        self.sent: list[object] = []

    def FetchState(self, request: pb.FetchStateRequest, timeout: float) -> Iterator:  # noqa: N802 (gRPC's)
        if self.states is None:
            raise Unreachable()
        return iter(self.states)

    def AdvertiseKeys(self, request: pb.AdvertiseKeysRequest, timeout: float) -> object:  # noqa: N802
        self.sent.append(request)
        return pb.AdvertiseKeysResponse(round_id=request.round_id)

    def __getattr__(self, name: str):
        def unreachable(*args, **kwargs):
            raise Unreachable()

        return unreachable


@dataclass
class Kit:
    """silo-0's agent (registered, its aggregator known), and what a hostile aggregator has at hand."""

    agent: SiloAgent
    key: object  # the aggregator's signing key
    base: round_pb2.RoundSpec  # a well-formed first round the agent accepts
    certificates: dict[str, bytes]  # each silo's, as the aggregator relays them to peers
    known: tuple[str | bytes, ...]  # values worth putting in messages

    def signed(self, blob: bytes) -> round_pb2.SignedRoundSpec:
        return round_pb2.SignedRoundSpec(spec=blob, signature=sign(self.key, blob, context=ROUNDSPEC_CONTEXT))

    @functools.cached_property
    def specs(self) -> st.SearchStrategy[object]:
        """(Recipes of) RoundSpec bytes: the accepted round with some fields changed, a generated spec, or
        raw bytes."""
        descriptor = round_pb2.RoundSpec.DESCRIPTOR
        near = st.builds(Over, st.just(self.base), messages(descriptor, self.known), st.booleans())
        return st.one_of(near, encoded(descriptor, self.known), raw_messages(descriptor, self.known))

    @functools.cached_property
    def directives(self) -> st.SearchStrategy[list]:
        """(Recipes of) a directive stream: generated directives, and RoundSpecs like `specs` (signed by
        `follow`)."""
        spec = self.specs.map(
            lambda blob: Made(
                pb.JoinResponse, (("round_spec", Made(round_pb2.SignedRoundSpec, (("spec", blob),))),)
            )
        )
        return st.lists(st.one_of(messages(pb.JoinResponse.DESCRIPTOR, self.known), spec), max_size=4)


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Kit:
    root = tmp_path_factory.mktemp("silo-fuzz")
    configs = write_kit(root)
    base = round_pb2.RoundSpec.FromString(
        signed_spec(root, state_digest=STATE.digest(), state_bytes=len(PACKED)).spec
    )
    certificates = {silo: (root / "pki" / f"{silo}.pem").read_bytes() for silo in SILOS}
    known = (base.round_id, *SILOS, base.method, base.privacy, base.state_digest, *certificates.values())
    key = load_private_key(root / "pki" / "aggregator.key")
    return Kit(agent_of((root, configs)), key, base, certificates, known)


# --- what a hostile aggregator signs ------------------------------------------------------------------


@dataclass(frozen=True)
class Over(Recipe):
    """`base` with every field `changes` sets replaced; `consistent`: its config hash matches its plan."""

    base: round_pb2.RoundSpec
    changes: Made
    consistent: bool

    def build(self) -> bytes:
        spec, changes = round_pb2.RoundSpec(), self.changes.build()
        spec.CopyFrom(self.base)
        for field, _ in changes.ListFields():
            spec.ClearField(field.name)
        spec.MergeFrom(changes)
        if self.consistent:
            spec.config_sha256 = hashlib.sha256(spec.method_config.encode()).hexdigest()
        return spec.SerializeToString()


def _model(change: str, pick: int, value: object) -> dict[str, torch.Tensor]:
    """The first round's model with one tensor (the `pick`-th, wrapping) renamed to `value`, flattened (the
    same numbers, so the schema's size, in another shape), filled with `value`, retyped to `value`, or
    gone."""
    model = dict(STATE.model)
    name = sorted(model)[pick % len(model)]
    tensor = model.pop(name)
    changed = {
        "renamed": lambda: {value: tensor},
        "flattened": lambda: {name: tensor.reshape(-1)},
        "filled": lambda: {name: torch.full_like(tensor, value)},
        "retyped": lambda: {name: tensor.to(value)},
        "gone": dict,
    }[change]()
    return {**model, **changed}


@functools.cache  # building a strategy costs more than drawing from it
def state_bytes() -> st.SearchStrategy[bytes]:
    """A first round's state as a hostile aggregator may stream it: raw bytes, the real state's bytes
    mutated, or a well-formed state whose model is not the plan's (`_model`)."""
    pick = st.integers(0, 2**16)
    alien = st.one_of(
        st.tuples(st.just("renamed"), pick, st.sampled_from(["x", "classifier.weight.0", *STATE.model])),
        st.tuples(st.just("flattened"), pick, st.none()),
        st.tuples(
            st.just("filled"), pick, st.sampled_from([float("nan"), float("inf"), -float("inf"), BIGGEST])
        ),
        st.tuples(
            st.just("retyped"), pick, st.sampled_from([torch.float64, torch.int64, torch.int32, torch.uint8])
        ),
        st.tuples(st.just("gone"), pick, st.none()),
    )
    # half the edits in the header (names, dtypes, shapes); one in the weights trains on a valid state
    where = st.integers(0, PACKED.index(b"}]") + 2) | st.integers(0, len(PACKED) - 1)
    edits = st.lists(st.tuples(where, st.integers(0, 255)), min_size=1, max_size=4)
    return st.one_of(
        alien.map(lambda args: pack_state(GlobalState(0, _model(*args), dict(STATE.extra)))),
        st.builds(mutated, st.just(PACKED), edits, st.none() | st.integers(0, len(PACKED))),
        st.binary(max_size=512),
    )


def _described(kit: Kit, data: bytes) -> round_pb2.RoundSpec:
    """The accepted round, claiming `data` as its state: its size, and its digest if it unpacks at all."""
    spec = round_pb2.RoundSpec()
    spec.CopyFrom(kit.base)
    spec.state_bytes = len(data)
    with contextlib.suppress(FedltError):
        spec.state_digest = unpack_state(data, spec.round - 1).digest()
    return spec


def _chunked(data: bytes, cuts: list[int]) -> list[pb.FetchStateResponse]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [pb.FetchStateResponse(offset=a, data=data[a:b]) for a, b in itertools.pairwise(bounds)]


# --- the checks ---------------------------------------------------------------------------------------


def check_spec(kit: Kit, blob: bytes) -> None:
    """A signed RoundSpec is accepted or refused with RefusedRound or PkiError, which `take_round` logs."""
    try:
        admitted = kit.agent.admission.check(SiloTransport(Stub()), kit.signed(blob))
    except (RefusedRound, PkiError):
        return
    assert isinstance(admitted.plan, RoundPlan)
    assert admitted.spec.SerializeToString() == round_pb2.RoundSpec.FromString(blob).SerializeToString()


def follow(kit: Kit, directives: list[pb.JoinResponse], resign: bool) -> None:
    """A directive stream ends the session normally, or with a gRPC error the agent reconnects after."""
    for directive in directives:
        if resign and directive.HasField("round_spec"):
            directive.round_spec.CopyFrom(kit.signed(directive.round_spec.spec))
    with contextlib.suppress(Unreachable):
        assert kit.agent.follow(SiloTransport(Stub()), iter(directives)) in (True, False)


def work(kit: Kit, data: bytes, parts: list[pb.FetchStateResponse] | None = None) -> bytes | None:
    """What the agent makes of a first round whose state is `data` (streamed as `parts`, by default whole)."""
    spec = _described(kit, data)
    chunks = [pb.FetchStateResponse(offset=0, data=data)] if parts is None else parts
    transport = SiloTransport(Stub(chunks))
    admitted = kit.agent.admission.check(transport, kit.signed(spec.SerializeToString()))
    assert admitted.trains
    started = kit.agent.admission.starting_state(transport, admitted)
    return None if started is None else kit.agent.work.train(transport, started)


def take_state(kit: Kit, data: bytes, parts: list[pb.FetchStateResponse]) -> None:
    """A state stream is refused (None) or trained on; a hostile one never stops the agent."""
    payload = work(kit, data, parts)
    assert payload is None or len(payload) == 8 * SIZE


def participation(kit: Kit) -> tuple[Participation, Stub]:
    """silo-0's part in the sums of the accepted round, started: its keys are advertised (to the stub)."""
    stub = Stub()
    taking_part = Participation(
        kit.base,
        roundspec.sums_of(kit.signed(kit.base.SerializeToString()), kit.base),
        torch.zeros(SIZE, dtype=torch.float64),
        me=SILOS[0],
        side=kit.agent.admission.sides["secagg"],
        gate=kit.agent.admission.gate,
        trained_from=kit.base.state_digest,
        ledger=kit.agent.ledger,
        transport=SiloTransport(stub, timeout=10.0),
        on_sent=lambda purpose, message: None,
    )
    taking_part.start()
    return taking_part, stub


def take_step(kit: Kit, step: pb.SumStep, with_own_keys: bool) -> None:
    """A sum step is taken or refused with a FedltError, which the agent's `Finish.stage` logs (a gRPC error,
    here from fetching an announced sum, makes the agent reconnect)."""
    taking_part, stub = participation(kit)
    if with_own_keys and step.WhichOneof("step") == "keys":
        (advertised,) = stub.sent
        step.keys.keys.add(
            silo_id=SILOS[0],
            c_public_key=advertised.c_public_key,
            s_public_key=advertised.s_public_key,
            signature=advertised.signature,
            certificate=kit.certificates[SILOS[0]],
        )
    with contextlib.suppress(FedltError, Unreachable):
        taking_part.step(step)


# --- the fuzzing: small and seeded by default; with -m slow 10,000 inputs a target (states: 1,000) --


def _specs(kit: Kit, data: st.DataObject) -> None:
    check_spec(kit, build(data.draw(kit.specs, label="spec")))


def _directives(kit: Kit, data: st.DataObject) -> None:
    stream = build(data.draw(kit.directives, label="directives"))
    follow(kit, stream, data.draw(st.booleans(), label="resign"))


def _states(kit: Kit, data: st.DataObject) -> None:
    state = data.draw(state_bytes(), label="state")
    cuts = data.draw(st.lists(st.integers(0, 2**20), max_size=3), label="cuts")
    take_state(kit, state, _chunked(state, cuts))


def _steps(kit: Kit, data: st.DataObject) -> None:
    step = build(data.draw(messages(pb.SumStep.DESCRIPTOR, kit.known), label="step"))
    take_step(kit, step, data.draw(st.booleans(), label="own keys"))


TARGETS = {"specs": _specs, "directives": _directives, "states": _states, "steps": _steps}


@contextlib.contextmanager
def unlogged() -> Iterator[None]:
    """The agent logs every refusal, quoting what it refuses, and pytest keeps every record of a test: over
    thousands of hostile inputs, tens of gigabytes."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("target", TARGETS)
@FUZZ
@given(data=st.data())
def test_a_hostile_aggregator_cannot_stop_the_silo_agent(kit, target, data):
    with unlogged():
        TARGETS[target](kit, data)


@pytest.mark.slow
@pytest.mark.parametrize("target", [name for name in TARGETS if name != "states"])
@settings(FUZZ, max_examples=SLOW_FUZZ_EXAMPLES, derandomize=False)
@given(data=st.data())
def test_a_hostile_aggregator_cannot_stop_the_silo_agent_in_ten_thousand_tries(kit, target, data):
    with unlogged():
        TARGETS[target](kit, data)


@pytest.mark.slow
@settings(FUZZ, max_examples=SLOW_STATES, derandomize=False)
@given(data=st.data())
def test_a_hostile_aggregators_states_cannot_stop_the_silo_agent_in_a_thousand_tries(kit, data):
    with unlogged():
        _states(kit, data)


# --- crashes the fuzzing found, pinned ---------------------------------------------------------------


def _alien(change: str, value: object, tensor: str = "classifier.bias") -> bytes:
    model = _model(change, sorted(STATE.model).index(tensor), value)
    return pack_state(GlobalState(0, model, dict(STATE.extra)))


@pytest.mark.parametrize(
    ("change", "value", "logged"),
    [
        ("renamed", "x", "the state's model lacks tensors ['classifier.bias'] and has others ['x']"),
        ("filled", float("nan"), "the state's model holds non-finite values in 'classifier.bias'"),
        ("retyped", torch.float64, "holds 'classifier.bias' as torch.float64 (10,), not torch.float32 (10,)"),
    ],
)
def test_a_state_that_is_not_the_plans_model_is_refused_not_a_stopped_agent(
    kit, caplog, change, value, logged
):
    """The aggregator signs the digest of whatever it streams, and these keep the schema's size: loading the
    renamed tensor raised torch's RuntimeError out of `Work.train`, training on NaN a ContributionError;
    either stopped the agent. A retyped tensor trained, on weights the network had rounded: not the ones
    signed."""
    assert work(kit, _alien(change, value)) is None
    assert logged in caplog.text


def test_weights_that_train_to_infinity_are_no_contribution_not_a_stopped_agent(kit, caplog):
    """Finite, so the state is the plan's model; the schema refused the contribution they train to with a
    ContributionError, which `Work.train` let out, and the agent stopped."""
    assert work(kit, _alien("filled", BIGGEST, tensor="encoder.0.weight")) is None
    assert f"not training: field 'delta' has {SIZE - 1} non-finite values" in caplog.text


def test_a_sum_step_that_carries_no_step_makes_the_silo_leave_the_round(kit, caplog):
    """It raised WireError, a ValueError, past `Finish.stage` (which catches FedltErrors): the agent
    stopped."""
    kit.agent.finish.taking_part, _ = participation(kit)
    empty = pb.SumStep(round_id=kit.base.round_id, sum=pb.SECURE_SUM_CONTRIBUTION)
    kit.agent.finish.sum_step(SiloTransport(Stub()), empty)
    assert kit.agent.finish.taking_part is None
    assert "leaving the round's sums: a SumStep with step None" in caplog.text
