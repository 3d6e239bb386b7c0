"""A hostile review of the layer registry, the generic wire and the key service (issue 32): each test mounts
one attack of the aggregator's operator (who sends any message and signs any RoundSpec) or of a malicious
silo, against the code as it is.

The first tests were findings: each attack succeeded against the code reviewed (each was marked as an
expected failure until its fix landed); they and the rest now assert the refusal, kept as regression tests.

Layers of this review are installed the way any distribution installs one: an entry-point line in a
dist-info on the import path (`install`), naming records in this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.service import ConsortiumServicer, Identity
from fedlt.aggregation import layers, record
from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.registry import KeyKind, LayerRecord, LayerWire, RegistryError
from fedlt.config import read_toml, render_toml
from fedlt.keepalive import aggregator_options, silo_options
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import layer_pb2, round_pb2
from fedlt.wire import FIELD
from fedlt.wire.codec import BadLayerMessage, WireError, decode, encode, entries_of
from privacy import roundspec, wire
from privacy.keyservice.ceremony import Announcement, CeremonyError, seal
from privacy.keyservice.wire import ENROLLMENT, SEALED, sealed_to_pb
from privacy.pki.identity import MemberTrust, RevocationList
from privacy.pki.roster import RosterFile
from privacy.pki.signing import load_private_key, sign
from privacy.roundspec import RoundSpecError
from privacy.secagg.wire import ENVELOPE, KEYS
from silo.admission import RefusedRound
from silo.agent import SiloAgent
from silo.key_service import Keyring
from silo.transport import SiloTransport
from tests.consortium_harness import write_kit
from tests.plugins.fedlt_toy_layer import ToySettings, ToySum
from tests.test_key_service import Caller, Refused
from tests.test_silo_refusals import RecordingStub, agent_of, check, signed_spec
from tests.toy import toy_installed

CONSORTIUM = "test-consortium"

# --- the layers this review installs ------------------------------------------------------------------------


class RawKey:
    """A consortium key of 32 raw bytes, as any layer keyed by a symmetric secret would read one."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != 32:
            raise ValueError(f"a key of {len(secret)} bytes")
        self.secret = secret
        self.context_id = hashlib.sha256(secret).hexdigest()

    def secret_bytes(self) -> bytes:
        return self.secret

    def public_bytes(self) -> bytes:
        return b""

    def derived_key(self, purpose: bytes) -> bytes:
        return hashlib.sha256(purpose + self.secret).digest()


RAW_KIND = KeyKind(new=lambda: RawKey(secrets.token_bytes(32)), from_secret_bytes=RawKey, read_public=bytes)


@dataclass(frozen=True)
class KeyedSettings(ToySettings):
    """Round parameters naming the key, as `KeyKind` asks of a layer with the key service."""

    context_id: str = ""
    key_holder: str = ""


CONSTRUCTED: list[str] = []  # every Probe made, by its note: a layer's code that ran


@dataclass(frozen=True)
class Probe:
    """A layer message whose constructor leaves a trace, as any validation in `__post_init__` would run."""

    note: str

    def __post_init__(self) -> None:
        CONSTRUCTED.append(self.note)


@dataclass(frozen=True)
class Picky:
    """A layer message that checks itself, indexing a table: an index out of range raises IndexError."""

    index: int

    def __post_init__(self) -> None:
        ("first", "second")[self.index]


@dataclass(frozen=True)
class Listed:
    """A layer message with a field the generic codec does not carry (a list, not a tuple)."""

    items: list[bytes]


def _sum(name: str) -> type[ToySum]:
    return type(f"{name.title()}Sum", (ToySum,), {"name": name})


KEYED = LayerRecord(name="keyed", layer=_sum("keyed"), settings=KeyedSettings, key_service=RAW_KIND)
KEYED_BARE = LayerRecord(name="bare", layer=_sum("bare"), key_service=RAW_KIND)
PROBE = LayerRecord(name="probe", layer=_sum("probe"), messages=(Probe, Picky))
SHADOW = LayerRecord(
    name="shadow", layer=_sum("shadow"), wire=LayerWire(receivers={"Register": lambda *_: None})
)
LISTED = LayerRecord(name="listed", layer=_sum("listed"), messages=(Listed,))
RECORDS = {"keyed": "KEYED", "bare": "KEYED_BARE", "probe": "PROBE", "shadow": "SHADOW", "listed": "LISTED"}


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Install this module's layers by name: a dist-info whose entry points name their records."""

    def installing(*names: str) -> None:
        info = tmp_path / "site" / "fedlt_review_layers-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedlt-review-layers\nVersion: 0.1\n")
        points = "".join(f"{name} = {__name__}:{RECORDS[name]}\n" for name in names)
        (info / "entry_points.txt").write_text(f"[fedlt.privacy_layers]\n{points}")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        layers.cache_clear()
        wire.tables.cache_clear()

    yield installing
    layers.cache_clear()
    wire.tables.cache_clear()


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[LayerRecord]:
    with toy_installed(monkeypatch):
        yield record("toy")


@pytest.fixture
def kit(tmp_path: Path) -> tuple[Path, list[Path]]:
    return tmp_path, write_kit(tmp_path / "kit")


def silo_listing(kit: tuple[Path, list[Path]], layer: str) -> SiloAgent:
    """silo-0's agent, its policy listing `layer` only (installed before the config is read)."""
    root, configs = kit[0] / "kit", kit[1]
    tree = read_toml(configs[0])
    tree["policy"] = {"privacy": [layer]}
    configs[0].write_text(render_toml(tree))
    return agent_of((root, configs))


def servicer(root: Path, privacy: str, delivered: list[tuple]) -> ConsortiumServicer:
    """The service of a consortium running `privacy`, over an inbox that records what it is handed."""
    pki = root / "pki"
    identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
    roster = RosterFile(pki / "roster.json")
    consortium = SimpleNamespace(id=CONSORTIUM, privacy=privacy)
    inbox = SimpleNamespace(
        config=SimpleNamespace(consortium=consortium), deliver=lambda *handed: delivered.append(handed)
    )
    return ConsortiumServicer(
        inbox,
        SimpleNamespace(),
        identity,
        b"",
        members=MemberTrust((pki / "ca" / "ca.pem").read_bytes(), roster, identity.revocations),
        roster=roster,
        relay=None,
        submit_seconds=10.0,
    )


def refusal_of(call: Callable[[], object]) -> Refused | None:
    """The refusal a servicer call aborts with (None: it answered)."""
    try:
        call()
    except Refused as refused:
        return refused
    return None


def layer_message(type_name: str, **values: layer_pb2.Value) -> layer_pb2.LayerMessage:
    return layer_pb2.LayerMessage(type=type_name, fields=layer_pb2.Entries(entries=values))


# --- findings: attacks that succeed -------------------------------------------------------------------------


def test_send_refuses_a_message_the_layer_takes_only_as_a_sized_upload(toy, kit):
    """A malicious silo sends its upload (the toy layer's Shares) through the unary Send RPC instead of a
    Submit stream: the service never asks the half's `upload_bytes` (Submit refuses any announced size above
    it before reading a byte) and never records the contribution's digest for the audit (`RoundInbox.upload`
    does, `deliver` does not). Only gRPC's 4 MiB default bounds it, and the half gets shares 8 KiB long where
    the schema's are 8 bytes a value. Attack succeeds: the Shares are decoded and delivered."""
    delivered: list[tuple] = []
    shares_type = toy.messages[0]
    assert shares_type in toy.uploads
    oversized = shares_type({"silo-1": b"\x00" * 8192, "silo-2": b"\x00" * 8192})
    request = pb.SendRequest(
        round_id="r1.a1.x", sum=pb.SECURE_SUM_CONTRIBUTION, message=encode(oversized, "toy.Shares")
    )
    caller = Caller((kit[0] / "kit" / "pki" / "silo-0.pem").read_bytes())
    refused = refusal_of(lambda: servicer(kit[0] / "kit", "toy", delivered).Send(request, caller))
    assert delivered == [], "an upload reached the layer's half through Send, past upload_bytes and the audit"
    assert refused is not None
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_silo_reads_a_step_only_as_a_message_of_its_rounds_layer(install):
    """The aggregator sends a SumStep whose `layer` names a message of an installed layer that the round
    does not run (and the silo's policy need not list): `step_from_pb` decodes against every installed
    layer's types, so that layer's dataclass is built at the silo (its `__post_init__` runs) before the
    round's half refuses it. docs/threat-model.md says a layer's code runs at a silo only if its policy lists
    it. Attack succeeds: the Probe is built."""
    install("probe")
    CONSTRUCTED.clear()
    step = pb.SumStep(
        round_id="r1.a1.x",
        sum=pb.SECURE_SUM_CONTRIBUTION,
        layer=layer_message("probe.Probe", note=layer_pb2.Value(string_value="ran at the silo")),
    )
    with contextlib.suppress(BadMessage):
        wire.step_from_pb(step, layer="secagg")
    assert CONSTRUCTED == [], "a message of a layer the round does not run was built at the silo"


def test_the_aggregator_reads_a_send_only_as_a_message_of_its_consortiums_layer(install, kit):
    """A silo of a secagg consortium sends a message of another installed layer through Send: the service
    decodes it against every installed layer's types and hands it to the inbox (the round's half refuses
    it only then). Attack succeeds: built and delivered."""
    install("probe")
    CONSTRUCTED.clear()
    delivered: list[tuple] = []
    request = pb.SendRequest(
        round_id="r1.a1.x",
        sum=pb.SECURE_SUM_CONTRIBUTION,
        message=layer_message("probe.Probe", note=layer_pb2.Value(string_value="ran at the aggregator")),
    )
    caller = Caller((kit[0] / "kit" / "pki" / "silo-0.pem").read_bytes())
    refused = refusal_of(lambda: servicer(kit[0] / "kit", "secagg", delivered).Send(request, caller))
    assert (CONSTRUCTED, delivered) == ([], []), "a message of a layer the consortium does not run was read"
    assert refused is not None
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_message_its_dataclass_refuses_with_any_error_is_a_refused_message():
    """`from_entries` turns only TypeError and ValueError from the dataclass into BadLayerMessage. A hostile
    index makes Picky raise IndexError, which escapes: at the aggregator an INTERNAL error with a traceback
    in its log, at a silo past `Finish.stage` (it catches FedltError and RpcError only), ending the
    agent's run. Attack succeeds: IndexError."""
    hostile = layer_message("review.Picky", index=layer_pb2.Value(int_value=7))
    with pytest.raises(BadLayerMessage, match="does not hold"):
        decode(hostile, {"review.Picky": Picky})


def test_a_refusal_quotes_a_hostile_field_name_cut_short():
    """A message with an unknown field named by a megabyte: the refusal quotes the name whole (the type name
    is cut to 64 characters, the field name is not), and the silo logs the refusal of an aggregator's step
    in full (`Finish.stage`), a megabyte a line. Attack succeeds: the whole name is in the refusal."""
    hostile = layer_message("review.Probe", **{"x" * 2**20: layer_pb2.Value(bool_value=True)})
    with pytest.raises(BadLayerMessage) as refused:
        decode(hostile, {"review.Probe": Probe})
    assert len(str(refused.value)) < 1000


def test_malformed_parameters_of_a_layer_with_a_key_service_are_a_refused_round_not_a_stopped_agent(
    install, kit
):
    """The aggregator signs a RoundSpec of a layer with the key service (carried by name through the generic
    codec) whose parameters do not read back: `KeyService.before_round` runs before the RoundSpec is checked,
    reads them with `roundspec.settings_of` and lets its RoundSpecError out of `SiloAgent.take_round`, and
    `SiloAgent.run` catches only gRPC and OS errors: the agent stops instead of refusing the round. Attack
    succeeds: RoundSpecError out of `take_round`."""
    install("keyed")
    agent = silo_listing(kit, "keyed")
    parameters = layer_pb2.Entries(
        entries={
            "context_id": layer_pb2.Value(string_value="ab"),
            "surprise": layer_pb2.Value(bool_value=True),
        }
    )
    stub = RecordingStub()
    signed = signed_spec(kit[0] / "kit", privacy="keyed", secagg=None, layer_parameters=parameters)
    agent.take_round(SiloTransport(stub), signed)
    assert stub.calls == ["Refuse"]
    assert "malformed" in stub.refusals[0].text


def test_a_layer_with_a_key_service_must_have_round_parameters_naming_its_key(install):
    """`KeyKind` says the runtime reads `context_id` and `key_holder` from the layer's round parameters, but
    the registry takes a layer with a key service and no settings: every RoundSpec of it then reads as None
    parameters and `KeyService.before_round` fails on `None.key_holder` (AttributeError) mid-round. Attack
    succeeds: the registry takes it."""
    install("bare")
    with pytest.raises(RegistryError, match="bare"):
        layers()


def test_a_key_sealed_for_one_layer_does_not_open_as_another_layers_key(kit):
    """Two layers with the key service (a silo's policy may list both, and a consortium may change its
    layer): the envelope binds consortium, holder, recipient and key id, but no layer, and one enrollment key
    serves every layer. The aggregator answers a FetchKey of layer `twin` with the envelope the key holder
    sealed of layer `keyed`'s key, and signs a RoundSpec naming that key: where the two layers read keys
    alike (raw secrets), the silo keeps one layer's key as the other's. Attack succeeds: it is kept."""
    root = kit[0] / "kit"
    pki = root / "pki"
    identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
    members = MemberTrust(
        (pki / "ca" / "ca.pem").read_bytes(), RosterFile(pki / "roster.json"), identity.revocations
    )
    enrollment = X25519PrivateKey.generate()
    recipient = Announcement("silo-0", enrollment.public_key().public_bytes_raw(), b"")
    holder_key = load_private_key(pki / "silo-1.key")
    keyed_key = RAW_KIND.new()
    envelope = seal(
        keyed_key,
        consortium=CONSORTIUM,
        layer="keyed",
        sender="silo-1",
        recipient=recipient,
        sign=lambda data, *, context: sign(holder_key, data, context=context),
    )
    reply = pb.FetchKeyResponse(
        sealed=sealed_to_pb(envelope), holder_certificate=(pki / "silo-1.pem").read_bytes()
    )
    stub = SimpleNamespace(FetchKey=lambda request, timeout: reply)
    twin = Keyring(kit[0] / "state", "twin", RAW_KIND)
    with contextlib.suppress(CeremonyError):
        twin.fetch(
            SiloTransport(stub, timeout=5.0),
            SimpleNamespace(context_id=keyed_key.context_id, key_holder="silo-1"),
            consortium=CONSORTIUM,
            me="silo-0",
            enrollment=enrollment,
            members=members,
        )
    assert twin.get(keyed_key.context_id) is None, "layer keyed's key was kept as layer twin's"


def test_a_layer_cannot_name_its_rpc_after_one_of_the_service(install):
    """`aggregator.service` installs each of `privacy.wire.receivers()` as a method of ConsortiumServicer by
    name, and the tables refuse only a name two layers take: a layer's receiver named Register replaces
    the service's own registration (and one named after no RPC fails the import with AttributeError).
    Attack succeeds: the tables take it."""
    install("shadow")
    with pytest.raises(RegistryError, match="Register"):
        wire.tables()


def test_a_message_the_codec_cannot_carry_is_refused_when_the_layer_is_installed(install):
    """A layer declaring a message with a field the codec does not carry (`list[bytes]`) is taken by the
    registry and the tables; the first message of it raises WireError (a ValueError, no FedltError) in the
    middle of a round, at whichever end sends it. Attack succeeds: the tables take it."""
    install("listed")
    with pytest.raises(RegistryError, match="Listed"):
        wire.tables()


def test_settings_carried_by_name_are_read_within_their_limits(toy):
    """Settings a layer carries by name (`RoundSpec.layer_parameters`) come back without the limits their
    fields declare (`setting(ge=0)`), which consortium.toml's reading enforces: a signed k_min of -7 reads
    as given. The silo's own floors still refuse it (the regression test below), but a field no policy
    floor watches would pass. Attack succeeds: -7 is read."""
    spec = round_pb2.RoundSpec(privacy="toy", layer_parameters=entries_of(ToySettings(k_min=-7)))
    try:
        read = roundspec.settings_of(spec)
    except RoundSpecError:
        return
    assert read.k_min >= 0, f"k_min {read.k_min} read from a signed RoundSpec"


# --- regressions: attacks the code refuses ------------------------------------------------------------------


def test_a_silo_refuses_a_tail_guard_carried_by_name_below_its_policy(toy, kit):
    agent = silo_listing(kit, "toy")
    signed = signed_spec(
        kit[0] / "kit", privacy="toy", secagg=None, layer_parameters=entries_of(ToySettings(k_min=-7))
    )
    with pytest.raises(
        RefusedRound, match=r"its sums are malformed: the toy parameters: toy\.k_min: must be >= 0"
    ):
        check(agent, signed)


MODULE_PATHS = st.sampled_from(
    ["os.system", "subprocess.Popen", "privacy.secagg.layer.LAYER", "fedlt.aggregation.registry.LayerRecord"]
)


def test_a_layer_message_names_a_registered_type_and_never_a_module_to_import(monkeypatch):
    """Type names are looked up in the registry's table, never imported: whatever name the aggregator or a
    silo writes, an unregistered one is refused and no module is loaded for it."""
    with toy_installed(monkeypatch):
        registered = wire.tables().generic

        names = MODULE_PATHS | st.text(max_size=80) | st.sampled_from(sorted(registered)).map(str.upper)

        @settings(max_examples=200, deadline=None)
        @given(names.filter(lambda name: name not in registered))
        def refused(name: str) -> None:
            loaded = set(sys.modules)
            with pytest.raises(BadLayerMessage, match="no layer carries"):
                decode(layer_message(name), registered)
            assert set(sys.modules) == loaded

        refused()


def _nested(depth: int) -> bytes:
    """A LayerMessage whose one field holds a list in a list ... `depth` deep, as raw bytes."""

    def length_delimited(number: int, payload: bytes) -> bytes:
        size, varint = len(payload), bytearray()
        while True:
            varint.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
            size >>= 7
            if not size:
                return bytes([number << 3 | 2]) + bytes(varint) + payload

    value = bytes([5 << 3, 1])  # bool_value true
    for _ in range(depth):
        value = length_delimited(6, length_delimited(1, value))  # Value.list_value.values
    entry = length_delimited(1, b"k") + length_delimited(2, value)
    return length_delimited(1, b"toy.Shares") + length_delimited(2, length_delimited(1, entry))


def test_a_deeply_nested_layer_message_is_refused_by_the_parser_not_by_a_recursion_error(toy):
    """The codec recurses only as deep as the dataclass's hints; the parser caps what arrives (upb's depth
    limit), so a hostile nesting is a refused upload, in a Submit stream or a state report alike."""
    for depth in (200, 20_000):
        with pytest.raises(BadLayerMessage, match="no LayerMessage"):
            wire.upload_of(pb.CONTRIBUTION_KIND_LAYER, _nested(depth), "toy.Shares", layer="toy")
    with pytest.raises(BadLayerMessage, match="no LayerMessage"):
        wire.upload_of(pb.CONTRIBUTION_KIND_LAYER, _nested(20_000), layer="toy")


def test_a_submit_holds_exactly_the_upload_its_header_announces(toy):
    """The header's message type sizes the upload (`upload_bytes`) before a byte is read; the payload must
    then hold that type, and only a layer's declared uploads may be announced."""
    shares_type, _, partial_type = toy.messages
    partial = encode(partial_type(b"\x00" * 8), "toy.Partial").SerializeToString()
    announced = pb.SubmitHeader(kind=pb.CONTRIBUTION_KIND_LAYER, message_type="toy.Shares")
    with pytest.raises(BadLayerMessage, match=r"announced as 'toy.Shares' holds a 'toy.Partial'"):
        wire.submitted(announced, partial, layer="toy")
    for message_type in ("toy.Partial", "", "toy.Inbox", "secagg.Shares"):
        header = pb.SubmitHeader(kind=pb.CONTRIBUTION_KIND_LAYER, message_type=message_type)
        with pytest.raises(WireError, match="is no upload of an installed layer"):
            wire.upload_type(header, layer="toy")
    assert wire.upload_type(announced, layer="toy") is shares_type


def test_no_unary_message_above_grpcs_four_mebibytes_reaches_a_handler():
    """Send (and every unary RPC) has no announced size: gRPC's default receive limit of 4 MiB is its cap,
    which neither end raises."""
    for options in (aggregator_options(30.0), silo_options(30.0)):
        assert "grpc.max_receive_message_length" not in dict(options)


@pytest.mark.parametrize("mapped", [FIELD, SEALED, ENROLLMENT, KEYS, ENVELOPE], ids=lambda m: m.cls.__name__)
def test_every_mapped_message_carries_each_field_both_ways(mapped):
    """`Mapped` checks that the message carries every dataclass field; a message field the dataclass lacks
    would be dropped without a word on reading: none is."""
    carried = {mapped.renamed.get(f.name, f.name) for f in dataclasses.fields(mapped.cls) if f.init}
    assert set(mapped.message.DESCRIPTOR.fields_by_name) == carried - set(mapped.local)
