"""A silo agent facing a lying aggregator: every RoundSpec parameter that could weaken its privacy is checked
against its own policy and roster, with the defaults a new silo gets, and refused before any work.

The aggregator's side is played with real certificates and signatures (the aggregator's key signs what a
malicious operator would send); a stub records what the silo calls, so a refusal is seen to send nothing but
the refusal itself (`ConsortiumService.Refuse`), whose words name the policy and the plan, never the silo's
data or budget.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest

from fedlt.aggregation import layer_names, make_layer
from fedlt.aggregation.halves import PartyKeys, SiloSide
from fedlt.aggregation.registry import record
from fedlt.config import read_toml, render_toml
from fedlt.errors import ConfigError
from fedlt.methods.state import pack_state
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from fedlt.wire.codec import entries_of
from privacy import roundspec
from privacy.blind.keys import OutputKey
from privacy.blind.layer import BlindSettings
from privacy.ckks.keys import SecretContext
from privacy.dp import BudgetExceeded
from privacy.pki.ca import issue_silo
from privacy.pki.errors import PkiError
from privacy.pki.signing import ROUNDSPEC_CONTEXT, sign
from silo.admission import TOLD, AdmittedRound, AdmittedSpec, RefusedRound, fetched_state
from silo.agent import SiloAgent
from silo.budget import ledger_path
from silo.config import load_silo_config
from silo.connection import Fatal
from silo.releases import LEDGER, LedgerMissing
from silo.transport import SiloTransport
from tests.consortium_harness import PLAN, write_kit

SILOS = ["silo-0", "silo-1", "silo-2"]


@pytest.fixture
def kit(tmp_path):
    """Three silos' configs as the demo writes them, with every policy setting at its default."""
    configs = write_kit(tmp_path)
    for path in configs:  # the demo's configs name their layer and method; a new silo's do not
        tree = read_toml(path)
        del tree["policy"]
        path.write_text(render_toml(tree))
    return tmp_path, configs


def agent_of(kit) -> SiloAgent:
    """silo-0's agent as registration leaves it: its id and the aggregator's certificate known."""
    root, configs = kit
    agent = SiloAgent(load_silo_config(configs[0]))
    agent.standing.silo_id = "silo-0"
    agent.standing.aggregator_pem = (root / "pki" / "aggregator.pem").read_bytes()
    registered = pb.RegisterResponse(silo_id="silo-0")  # naming no key holder: the key service sends nothing
    agent.keys.registered(SiloTransport(RecordingStub()), registered)
    return agent


SCHEMA = PLAN.build_method().schema(PLAN.build_method().init_state(seed=0))


def signed_spec(root, key: str = "aggregator", **changes) -> round_pb2.SignedRoundSpec:
    plan = PLAN.to_toml()
    fields = {
        "consortium_id": "test-consortium",
        "round": 1,
        "attempt": 1,
        "round_id": "r1.a1.x",
        "method": PLAN.method.name,
        "method_config": plan,
        "schema": schema_to_pb(SCHEMA),
        "config_sha256": hashlib.sha256(plan.encode()).hexdigest(),
        "privacy": "secagg",
        "participants": SILOS,
        "secagg": round_pb2.SecAggParameters(k_min=2),
    }
    spec = round_pb2.RoundSpec(**(fields | changes))
    blob = spec.SerializeToString()
    return round_pb2.SignedRoundSpec(
        spec=blob, signature=sign(root / "pki" / f"{key}.key", blob, context=ROUNDSPEC_CONTEXT)
    )


class RecordingStub:
    """Takes refusals and answers nothing else; remembers every call, so a test can see that a refused round
    sent nothing but its refusal (`refusals`: what the aggregator was told)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.refusals: list[pb.RefuseRequest] = []

    def Refuse(self, request: pb.RefuseRequest, timeout=None) -> pb.RefuseResponse:  # noqa: N802 (gRPC's)
        self.calls.append("Refuse")
        self.refusals.append(request)
        return pb.RefuseResponse(round_id=request.round_id)

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"the silo called {name} for a round it should have refused")

        return call


def check(agent: SiloAgent, signed: round_pb2.SignedRoundSpec, stub: object | None = None) -> AdmittedSpec:
    """`agent`'s admission of `signed`, over `stub` (by default one that takes nothing but refusals)."""
    return agent.admission.check(SiloTransport(stub or RecordingStub()), signed)


def test_the_default_policy_accepts_only_secure_aggregation(kit):
    agent = agent_of(kit)
    assert agent.config.policy.privacy == ("secagg",)
    spec = check(agent, signed_spec(kit[0])).spec
    assert spec.privacy == "secagg"


@pytest.mark.parametrize("layer", ["ckks", "plaintext", "CKKS", ""])
def test_a_roundspec_asking_for_a_layer_the_silo_does_not_implement_or_allow_sends_nothing(
    kit, layer, caplog
):
    """The critical finding: `ckks` once made the agent upload its contribution in the clear."""
    agent = agent_of(kit)
    with pytest.raises(RefusedRound, match="privacy layer"):
        check(agent, signed_spec(kit[0], privacy=layer))
    stub = RecordingStub()
    agent.take_round(SiloTransport(stub), signed_spec(kit[0], privacy=layer))
    assert stub.calls == ["Refuse"]  # the refusal, so that the aggregator waits for nothing; nothing else
    (told,) = stub.refusals
    assert (told.round_id, told.code) == ("r1.a1.x", pb.REFUSAL_CODE_POLICY)
    assert f"privacy layer {layer!r} is not" in told.text
    assert "refusing a round" in caplog.text


def test_every_layer_a_policy_may_list_has_its_own_side_and_only_those_it_lists(kit):
    agent = agent_of(kit)
    assert set(agent.admission.sides) == {
        "secagg"
    }  # the default policy: the plaintext layer is not even built
    sides = {name: make_layer(name).silo_side(PartyKeys(secret=_shared_key(name))) for name in layer_names()}
    assert all(isinstance(side, SiloSide) for side in sides.values())


def _shared_key(layer: str) -> object:
    """A new key of the layer's kind where it asks for the key service (ckks, blind), else none."""
    kind = record(layer).key_service
    return None if kind is None else kind.new()


def test_a_policy_cannot_name_a_layer_the_agent_does_not_implement(kit):
    _, configs = kit
    configs[0].write_text(configs[0].read_text() + '\n[policy]\nprivacy = ["secagg", "paillier"]\n')
    with pytest.raises(ConfigError, match=r"policy.privacy: \['paillier'\] not installed with this agent"):
        load_silo_config(configs[0])


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"participants": SILOS[:2]}, "2 silos in the contribution sum, fewer than policy.min_participants"),
        ({"secagg": round_pb2.SecAggParameters(k_min=2, threshold=2)}, "threshold 2 of 3 share holders"),
        ({"secagg": round_pb2.SecAggParameters(k_min=1)}, "tail guard k_min 1 is below"),
        (
            {
                "participants": [f"silo-{k}" for k in range(12)],
                "secagg": round_pb2.SecAggParameters(k_min=2, neighbours=2),
            },
            "accepts only the complete graph",
        ),
        ({"consortium_id": "another"}, "it is for consortium 'another'"),
        ({"participants": ["silo-1", "silo-2", "silo-3"]}, "not among the participants"),
        ({"participants": ["ghost", "silo-0", "silo-1"]}, "lists ghost, not silos of this silo's roster"),
    ],
)
def test_weakened_secure_sums_and_misaddressed_rounds_are_refused_by_default(kit, changes, refusal):
    with pytest.raises(RefusedRound, match=refusal):
        check(agent_of(kit), signed_spec(kit[0], **changes))


def test_an_agent_whose_release_ledger_was_lost_refuses_to_start(kit):
    """Finding 8a: delete releases.json (or restore half a backup) and a restarted silo would sign a second
    survivor set for what it released before; it stops instead, naming the file to restore."""
    _, configs = kit
    agent = agent_of(kit)
    ledger = agent.state_dir / LEDGER
    privacy = ledger_path(agent.config)
    backup = ledger.read_bytes()  # made at first start, as the privacy ledger is
    assert privacy.exists()
    del agent  # it stops, letting go of its state directory (`fedlt.dir_lock`) for the restarts below
    ledger.unlink()
    with pytest.raises(LedgerMissing, match=r"Restore releases\.json from a backup"):
        SiloAgent(load_silo_config(configs[0]))
    ledger.write_bytes(backup)  # restored from the backup ...
    privacy.unlink()  # ... but the privacy ledger is gone: the budget would be spent again
    with pytest.raises(LedgerMissing, match="would spend its differential-privacy budget again"):
        SiloAgent(load_silo_config(configs[0]))


def test_a_malformed_plan_is_a_refused_round_not_a_stopped_agent(kit, caplog):
    bad = "[model\nname = "
    signed = signed_spec(kit[0], method_config=bad, config_sha256=hashlib.sha256(bad.encode()).hexdigest())
    agent = agent_of(kit)
    with pytest.raises(RefusedRound, match="method_config is not a plan this silo can run"):
        check(agent, signed)
    agent.take_round(SiloTransport(RecordingStub()), signed)  # logs and goes on
    assert "refusing a round" in caplog.text
    garbage = round_pb2.SignedRoundSpec(
        spec=b"\xff\xff",
        signature=sign(kit[0] / "pki" / "aggregator.key", b"\xff\xff", context=ROUNDSPEC_CONTEXT),
    )
    with pytest.raises(RefusedRound, match="does not parse"):
        check(agent, garbage)


def test_only_the_rosters_aggregator_may_sign_roundspecs(kit, tmp_path):
    """A silo's certificate, or one the CA issued for the occasion, is not the aggregator, however valid."""
    root, _ = kit
    agent = agent_of(kit)
    agent.standing.aggregator_pem = (root / "pki" / "silo-1.pem").read_bytes()
    with pytest.raises(PkiError, match="does not name this certificate"):
        check(agent, signed_spec(root, key="silo-1"))
    issue_silo(root / "pki" / "ca", tmp_path, silo_id="aggregator")  # CA-issued, named like the aggregator
    agent.standing.aggregator_pem = (tmp_path / "aggregator.pem").read_bytes()
    with pytest.raises(PkiError, match="does not name this certificate"):
        check(agent, signed_spec(root))


class RegisteringStub:
    def __init__(self, reply: pb.RegisterResponse) -> None:
        self.reply = reply

    def Register(self, request, timeout=None):  # noqa: N802
        return self.reply


def test_registration_checks_the_tls_endpoint_and_the_signer_against_the_roster(kit):
    root, _ = kit
    agent = agent_of(kit)
    aggregator = (root / "pki" / "aggregator.pem").read_bytes()
    silo = (root / "pki" / "silo-1.pem").read_bytes()
    good = pb.RegisterResponse(
        silo_id="silo-0", consortium_id="test-consortium", aggregator_certificate=aggregator
    )
    agent.connection.register(SiloTransport(RegisteringStub(good)), aggregator)
    cases = {
        "a TLS endpoint the roster does not name": (good, silo),
        "a signer the roster does not name": (replace_reply(good, aggregator_certificate=silo), aggregator),
        "another consortium": (replace_reply(good, consortium_id="elsewhere"), aggregator),
    }
    for reply, tls in cases.values():
        with pytest.raises(Fatal, match="is not this consortium's"):
            agent.connection.register(SiloTransport(RegisteringStub(reply)), tls)


def replace_reply(reply: pb.RegisterResponse, **changes) -> pb.RegisterResponse:
    copy = pb.RegisterResponse()
    copy.CopyFrom(reply)
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


class StreamingStub:
    def __init__(self, parts) -> None:
        self.parts = parts
        self.read = 0

    def FetchState(self, request, timeout=None):  # noqa: N802
        for part in self.parts:
            self.read += 1
            yield part


def test_a_state_stream_is_read_only_as_far_as_the_signed_size():
    spec = round_pb2.RoundSpec(round_id="r", state_bytes=8)
    endless = StreamingStub(pb.FetchStateResponse(offset=8 * i, data=bytes(8)) for i in itertools.count())
    assert fetched_state(SiloTransport(endless), spec) is None
    assert endless.read == 2  # it stopped at the first chunk beyond the signed size
    out_of_order = StreamingStub([pb.FetchStateResponse(offset=4, data=bytes(8))])
    assert fetched_state(SiloTransport(out_of_order), spec) is None
    short = StreamingStub([pb.FetchStateResponse(offset=0, data=bytes(4))])
    assert fetched_state(SiloTransport(short), spec) is None
    whole = StreamingStub([pb.FetchStateResponse(offset=0, data=b"12345678")])
    assert fetched_state(SiloTransport(whole), spec) == b"12345678"


class NoKeyStub(RecordingStub):
    """An aggregator that holds no key sealed to this silo: the silo asks for the key a RoundSpec names."""

    def FetchKey(self, request: pb.FetchKeyRequest, timeout=None):  # noqa: N802 (gRPC's)
        self.calls.append("FetchKey")
        raise NoSuchKey()


class NoSuchKey(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "no key sealed to silo-0 under that id"


def test_a_ckks_round_naming_a_key_this_silo_does_not_hold_is_refused_and_sends_nothing(kit):
    """ckks must be listed explicitly; then a RoundSpec naming a key the silo was never sealed (an aggregator
    that made its own key, or a stale one) is refused before any work: nothing is fetched or uploaded."""
    _, configs = kit
    configs[0].write_text(configs[0].read_text() + '\n[policy]\nprivacy = ["ckks"]\n')
    agent = agent_of(kit)
    held = agent.keys.keyrings["ckks"].rotate()  # a key this silo does hold, as key holder
    made_up = SecretContext.new().context_id
    ckks = {"privacy": "ckks", "secagg": None}
    stub = NoKeyStub()
    with pytest.raises(RefusedRound, match="does not hold the ckks key"):
        check(
            agent,
            signed_spec(kit[0], **ckks, ckks=round_pb2.CkksParameters(k_min=2, context_id=made_up)),
            stub,
        )
    assert stub.calls == ["FetchKey"]  # the key asked for, and nothing else
    spec = check(
        agent, signed_spec(kit[0], **ckks, ckks=round_pb2.CkksParameters(k_min=2, context_id=held.context_id))
    ).spec
    assert spec.ckks.context_id == held.context_id
    with pytest.raises(RefusedRound, match="tail guard k_min 1"):
        check(
            agent,
            signed_spec(kit[0], **ckks, ckks=round_pb2.CkksParameters(k_min=1, context_id=held.context_id)),
        )


def blind_agent(kit) -> tuple[SiloAgent, str]:
    """silo-0's agent with a policy that lists blind, and the id of the blind key it holds (as key holder)."""
    _, configs = kit
    configs[0].write_text(configs[0].read_text() + '\n[policy]\nprivacy = ["blind"]\n')
    agent = agent_of(kit)
    return agent, agent.keys.keyrings["blind"].rotate().context_id


def blind_spec(context_id: str, **settings) -> dict[str, object]:
    """The RoundSpec fields of a blind round naming the key `context_id`, with `settings` (its defaults, the
    tail guard at k_min 2, otherwise). It names no key holder, so the key service shares nothing."""
    blind = BlindSettings(**{"k_min": 2, "context_id": context_id, **settings})
    return {"privacy": "blind", "secagg": None, "layer_parameters": entries_of(blind)}


BLIND_WEAKENED = [
    ({"participants": SILOS[:2]}, {}, "2 silos in the contribution sum, fewer than policy.min_participants"),
    ({}, {"threshold": 2}, "threshold 2 of 3 share holders"),
    ({}, {"k_min": 1}, "tail guard k_min 1 is below"),
    (
        {"participants": [f"silo-{k}" for k in range(12)]},
        {"neighbours": 2},
        "accepts only the complete graph",
    ),
    ({"consortium_id": "another"}, {}, "it is for consortium 'another'"),
    ({"participants": ["silo-1", "silo-2", "silo-3"]}, {}, "not among the participants"),
    ({"participants": ["ghost", "silo-0", "silo-1"]}, {}, "lists ghost, not silos of this silo's roster"),
]


@pytest.mark.parametrize(("changes", "settings", "refusal"), BLIND_WEAKENED)
def test_weakened_blind_sums_and_misaddressed_rounds_are_refused_by_default(kit, changes, settings, refusal):
    """blind's sums are secagg's: the same floors (participants, threshold, tail guard, complete graph) and
    the same roster, refused before any work. The round itself is admitted as signed."""
    agent, held = blind_agent(kit)
    assert check(agent, signed_spec(kit[0], **blind_spec(held))).spec.privacy == "blind"
    spec = {**blind_spec(held, **settings), **changes}
    stub = RecordingStub()
    with pytest.raises(RefusedRound, match=refusal):
        check(agent, signed_spec(kit[0], **spec), stub)
    assert stub.calls == []


def test_a_blind_round_naming_a_key_this_silo_does_not_hold_is_refused_and_sends_nothing(kit):
    """The attack: an aggregator that made an output key of its own names it in the RoundSpec, so that silos
    would mask with a key it holds and it would read every sum. A silo masks only with a key the key holder
    sealed to it: it asks for the key named, gets none, and refuses before any work."""
    agent, _ = blind_agent(kit)
    made_up = OutputKey.new().context_id
    stub = NoKeyStub()
    with pytest.raises(RefusedRound, match="does not hold the blind key"):
        check(agent, signed_spec(kit[0], **blind_spec(made_up)), stub)
    assert stub.calls == ["FetchKey"]  # the key asked for, and nothing else


# --- refusals the aggregator hears (issue 31, item 5) -------------------------------------------------


def test_a_roundspec_another_certificate_signed_is_refused_as_such_to_the_aggregator(kit):
    root, _ = kit
    agent = agent_of(kit)
    agent.standing.aggregator_pem = (root / "pki" / "silo-1.pem").read_bytes()
    stub = RecordingStub()
    agent.take_round(SiloTransport(stub), signed_spec(root, key="silo-1"))
    (told,) = stub.refusals
    assert (told.round_id, told.code) == ("r1.a1.x", pb.REFUSAL_CODE_SIGNATURE)
    assert "does not name this certificate" in told.text


class RefusalRefused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "no attempt 'r1.a1.x' in flight"


class RefusingStub:
    """An aggregator that takes no refusal (the attempt has moved on, or the network failed)."""

    def Refuse(self, request, timeout=None):  # noqa: N802
        raise RefusalRefused()


def test_a_refusal_the_aggregator_does_not_take_leaves_the_agent_going(kit, caplog):
    caplog.set_level(logging.WARNING, logger="silo")
    agent_of(kit).take_round(SiloTransport(RefusingStub()), signed_spec(kit[0], privacy="ckks"))  # no crash
    assert "refusing a round: r1.a1.x: privacy layer 'ckks'" in caplog.text
    assert "the aggregator did not take this refusal (FAILED_PRECONDITION" in caplog.text


class StateStub(RecordingStub):
    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.data = data

    def FetchState(self, request, timeout=None):  # noqa: N802
        return iter([pb.FetchStateResponse(offset=0, data=self.data)])


def test_a_state_that_is_not_the_signed_one_is_refused_to_the_aggregator(kit):
    """It was only logged ("not training"), and the round waited for this silo until its deadline."""
    packed = pack_state(PLAN.build_method().init_state(seed=0))
    signed = signed_spec(kit[0], state_digest="ab" * 32, state_bytes=len(packed))
    stub = StateStub(packed)
    agent = agent_of(kit)
    admitted = check(agent, signed)
    assert admitted.plan == PLAN
    assert agent.admission.starting_state(SiloTransport(stub), admitted) is None
    (told,) = stub.refusals
    assert told.code == pb.REFUSAL_CODE_STATE
    assert told.text == "the state received does not match the signed digest; not training"


def test_a_budget_refusal_tells_the_aggregator_no_figure_of_the_silos_budget(kit, caplog):
    """The ε a silo has spent is its own to report (dp.report); refusing a round must not tell it anyway."""
    spent = (
        "refusing DP-SGD for round 1: it would take this silo's privacy spending from ε = 2.71 to ε = 3.14 "
        "(δ = 1e-05), past its budget of ε = 3"
    )

    def over_budget(*args, **kwargs):
        raise BudgetExceeded(spent)

    stub = RecordingStub()
    agent = agent_of(kit)
    method = SimpleNamespace(local_round=over_budget)
    admitted = AdmittedRound.starting_from(check(agent, signed_spec(kit[0])), state=None, method=method)
    assert (admitted.plan, admitted.trains) == (PLAN, True)
    assert agent.work.train(SiloTransport(stub), admitted) is None
    (told,) = stub.refusals
    assert told.code == pb.REFUSAL_CODE_BUDGET
    assert told.text == TOLD[pb.REFUSAL_CODE_BUDGET]
    assert not any(figure in told.text for figure in ("2.71", "3.14", "ε", "1e-05"))
    assert spent in caplog.text  # the silo's own log keeps the figures


@pytest.mark.parametrize(
    "local",
    [
        "local data names classes ['pneumonia', 'covid-19'], which the plan does not: ['normal', 'viral']",
        "local data is (3, 224, 224) images in /srv/hospital-a/xray/train.npz, 1207 records",
    ],
)
def test_a_data_refusal_tells_the_aggregator_no_fact_of_the_local_data(kit, caplog, local):
    stub = RecordingStub()
    refusal = RefusedRound(f"r1.a1.x: {local}", code=pb.REFUSAL_CODE_DATA)
    agent_of(kit).admission.refuse(SiloTransport(stub), "r1.a1.x", refusal)
    (told,) = stub.refusals
    assert (told.code, told.text) == (pb.REFUSAL_CODE_DATA, TOLD[pb.REFUSAL_CODE_DATA])
    assert local in caplog.text


def test_data_that_does_not_fit_the_plan_is_refused_without_telling_the_aggregator_how(kit):
    """Through the agent's own check: the plan asks for 16x16 images, the silo holds 8x8 ones."""
    plan = PLAN.to_toml().replace("image_shape = [1, 8, 8]", "image_shape = [1, 16, 16]")
    assert plan != PLAN.to_toml()
    signed = signed_spec(kit[0], method_config=plan, config_sha256=hashlib.sha256(plan.encode()).hexdigest())
    stub = RecordingStub()
    agent_of(kit).take_round(SiloTransport(stub), signed)
    (told,) = stub.refusals
    assert told.code == pb.REFUSAL_CODE_DATA
    assert "(1, 8, 8)" not in told.text


def test_the_activity_status_shows_is_idle_once_a_silo_refuses_or_leaves_a_round(kit):
    """Found walking through the operator guide: silos that had left or refused a round still showed
    `training` while the aggregator gathered the next one."""
    agent = agent_of(kit)
    agent.standing.activity = pb.SILO_ACTIVITY_TRAINING
    agent.admission.refuse(SiloTransport(RefusingStub()), "r1.a1.x", RefusedRound("r1.a1.x: not allowed"))
    assert agent.standing.activity == pb.SILO_ACTIVITY_IDLE
    agent.standing.activity = pb.SILO_ACTIVITY_UPLOADING
    agent.finish.stage("r1.a1.x", lambda: (_ for _ in ()).throw(RefusedRound("a step this silo refuses")))
    assert agent.standing.activity == pb.SILO_ACTIVITY_IDLE


# --- one admission per RoundSpec (issue 32) -----------------------------------------------------------


class TakingStub(StateStub):
    """Serves the round's state and takes every message of its sums."""

    def __getattr__(self, name: str):
        def call(*args, **kwargs) -> None:
            self.calls.append(name)

        return call


def counting(reads: Counter, name: str, read: Callable) -> Callable:
    def counted(*args, **kwargs):
        reads[name] += 1
        return read(*args, **kwargs)

    return counted


@pytest.mark.parametrize("layer", ["secagg", "ckks"])
def test_a_roundspec_is_opened_and_its_parameters_read_once_per_round(kit, layer, monkeypatch):
    """The agent verified the signed RoundSpec twice and read its layer's parameters three times (five under
    ckks, six with the server step): admission now reads it once, into the one object later steps read."""
    _, configs = kit
    configs[0].write_text(configs[0].read_text() + f'\n[policy]\nprivacy = ["{layer}"]\n')
    agent = agent_of(kit)
    state = PLAN.build_method().init_state(seed=0)
    packed = pack_state(state)
    changes = {"state_digest": state.digest(), "state_bytes": len(packed)}
    if layer == "ckks":
        held = agent.keys.keyrings["ckks"].rotate()
        parameters = round_pb2.CkksParameters(k_min=2, context_id=held.context_id, key_holder="silo-1")
        changes |= {"privacy": "ckks", "secagg": None, "ckks": parameters}
    reads: Counter = Counter()
    for name in ("open_signed", "settings_of"):
        monkeypatch.setattr(roundspec, name, counting(reads, name, getattr(roundspec, name)))
    stub = TakingStub(packed)
    agent.take_round(SiloTransport(stub), signed_spec(kit[0], **changes))
    assert stub.refusals == []
    assert agent.finish.taking_part is not None  # trained, and in the round's sums
    assert stub.calls  # their first message sent
    assert reads == {"open_signed": 1, "settings_of": 1}
