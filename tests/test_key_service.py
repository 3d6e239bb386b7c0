"""The key service as a runtime capability: the aggregator builds its relay only for a layer that asks for
one and refuses the key calls clearly where there is none; the silo keeps one keyring per layer that asks for
one, one enrollment key, shares as key holder only the key of the layer the aggregator runs, and rotates a key
with `python -m silo keys rotate`.

The ceremony's attacks are tests/test_ckks_ceremony.py's and the relay's tests/test_ckks_release.py's (under
ckks, the one layer with a key service); the stand-in key kind here lets a second layer ask for the service.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from aggregator.key_service import KeyServiceRelay
from aggregator.service import ConsortiumServicer, Identity
from fedlt.aggregation import record
from fedlt.aggregation.registry import KeyKind
from fedlt.config import read_toml, render_toml
from fedlt.v1 import consortium_pb2 as pb
from privacy.ckks.settings import CkksSettings
from privacy.keyservice.ceremony import ANNOUNCE_CONTEXT, Announcement
from privacy.pki.identity import MemberTrust, RevocationList, read_certificate
from privacy.pki.roster import RosterFile
from privacy.pki.signing import load_private_key, sign, verify
from silo import key_service
from silo.__main__ import main as silo_main
from silo.config import load_silo_config
from silo.key_service import KeyService, MissingKey
from silo.transport import SiloTransport
from tests.consortium_harness import write_kit

KEY_CALLS = {
    "ListEnrollments": pb.ListEnrollmentsRequest(),
    "ShareKey": pb.ShareKeyRequest(context_id="a" * 64, public_key=b"public"),
    "FetchKey": pb.FetchKeyRequest(context_id="a" * 64),
}


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Caller:
    """What a servicer reads of a call: the verified client certificate; an abort raises `Refused`."""

    def __init__(self, pem: bytes) -> None:
        self.pem = pem

    def auth_context(self) -> dict:
        return {"x509_pem_cert": [self.pem]}

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(code, details)


class FakeKey:
    """A stand-in consortium key for a second layer asking for the key service (no TenSEAL)."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.context_id = hashlib.sha256(secret).hexdigest()

    def secret_bytes(self) -> bytes:
        return self.secret

    def public_bytes(self) -> bytes:
        return b"public of " + self.context_id.encode()

    def derived_key(self, purpose: bytes) -> bytes:
        return hashlib.sha256(purpose + self.secret).digest()


FAKE_KIND = KeyKind(
    new=lambda: FakeKey(hashlib.sha256(str(id(object())).encode()).digest()),
    from_secret_bytes=FakeKey,
    read_public=lambda raw: raw,
)


@pytest.fixture
def kit(tmp_path) -> tuple[Path, list[Path]]:
    return tmp_path, write_kit(tmp_path)


def servicer_for(root: Path, relay: KeyServiceRelay | None, privacy: str) -> ConsortiumServicer:
    pki = root / "pki"
    identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
    roster = RosterFile(pki / "roster.json")
    consortium = SimpleNamespace(id="test-consortium", privacy=privacy)
    return ConsortiumServicer(
        SimpleNamespace(config=SimpleNamespace(consortium=consortium)),
        SimpleNamespace(register_silo=lambda *args: None),
        identity,
        b"",
        members=MemberTrust((pki / "ca" / "ca.pem").read_bytes(), roster, identity.revocations),
        roster=roster,
        relay=relay,
        submit_seconds=10.0,
    )


def registration(root: Path, silo: str = "silo-0") -> pb.RegisterRequest:
    """A silo whose policy lists ckks registering, with its enrollment key signed as the agent signs it."""
    key = load_private_key(root / "pki" / f"{silo}.key")
    public = bytes(range(32))
    unsigned = Announcement(silo, public, b"").message("test-consortium")
    signature = sign(key, unsigned, context=ANNOUNCE_CONTEXT)
    return pb.RegisterRequest(
        agent_version="test",
        accepted_methods=["fedavg"],
        accepted_privacy=["ckks", "secagg"],
        key_enrollment=pb.KeyEnrollment(public_key=public, signature=signature),
    )


# --- the aggregator -----------------------------------------------------------------------------------------


def test_a_layer_without_a_key_service_gets_no_relay_and_every_key_call_is_refused_saying_why(kit):
    """The attack, on the code before: the relay was built for every layer, so under secagg any silo was
    handed every enrollment a silo had announced (ListEnrollments answered OK, as tests/test_fuzz_rpc.py
    expected) and its key calls reached a relay with no key holder. Now secagg gets no relay: the key calls
    are refused (FAILED_PRECONDITION, naming the layer), and an enrollment is taken but not kept."""
    root, _ = kit
    caller = Caller((root / "pki" / "silo-0.pem").read_bytes())
    other = Caller((root / "pki" / "silo-1.pem").read_bytes())
    built_anyway = servicer_for(root, KeyServiceRelay("ckks", record("ckks").key_service, ""), "secagg")
    built_anyway.Register(registration(root, "silo-1"), other)
    (listed,) = built_anyway.ListEnrollments(pb.ListEnrollmentsRequest(), caller).enrollments
    assert listed.silo_id == "silo-1"  # the attack: another silo's enrollment, under a layer with no keys
    assert KeyServiceRelay.for_layer(record("secagg"), None) is None
    servicer = servicer_for(root, None, "secagg")
    servicer.Register(registration(root, "silo-1"), other)
    for name, request in KEY_CALLS.items():
        with pytest.raises(Refused) as refused:
            getattr(servicer, name)(request, caller)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, name
        assert "(secagg) has no key service" in refused.value.details
    reply = servicer.Register(registration(root), caller)
    assert (reply.silo_id, reply.key_holder, reply.key_layer) == ("silo-0", "", "")


def test_a_layer_with_a_key_service_gets_a_relay_naming_its_key_holder_that_keeps_enrollments(kit):
    root, _ = kit
    relay = KeyServiceRelay.for_layer(record("ckks"), CkksSettings(key_holder="silo-1"))
    assert (relay.layer, relay.key_holder, relay.public) == ("ckks", "silo-1", None)
    servicer = servicer_for(root, relay, "ckks")
    pem = (root / "pki" / "silo-0.pem").read_bytes()
    reply = servicer.Register(registration(root), Caller(pem))
    assert (reply.key_holder, reply.key_layer) == ("silo-1", "ckks")
    (kept,) = servicer.ListEnrollments(pb.ListEnrollmentsRequest(), Caller(pem)).enrollments
    assert (kept.silo_id, kept.public_key, kept.certificate) == ("silo-0", bytes(range(32)), pem)
    with pytest.raises(Refused) as refused:  # the key has not been shared: a silo fetching it waits
        servicer.FetchKey(KEY_CALLS["FetchKey"], Caller(pem))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(Refused) as refused:  # silo-0 is not the key holder
        servicer.ShareKey(KEY_CALLS["ShareKey"], Caller(pem))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


# --- the silo -----------------------------------------------------------------------------------------------


class KeyStub:
    """The aggregator's key calls as the key holder makes them, recorded."""

    def __init__(self) -> None:
        self.shared: list[pb.ShareKeyRequest] = []

    def ListEnrollments(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        return pb.ListEnrollmentsResponse()

    def ShareKey(self, request, timeout):  # noqa: N802
        self.shared.append(request)
        return pb.ShareKeyResponse(context_id=request.context_id)


@pytest.fixture
def two_key_layers(monkeypatch):
    """secagg and ckks both asking for the key service, with the stand-in key kind."""
    monkeypatch.setattr(key_service, "record", lambda name: SimpleNamespace(key_service=FAKE_KIND))


def service(root: Path, privacy: tuple[str, ...]) -> KeyService:
    key = load_private_key(root / "pki" / "silo-0.key")
    trust = SimpleNamespace(roster=SimpleNamespace(consortium="test-consortium"), members=None)
    return KeyService(
        root / "state",
        privacy,
        trust=trust,
        sign=lambda data, *, context: sign(key, data, context=context),
    )


def test_a_silo_has_one_enrollment_key_for_every_layer_with_a_key_service(kit, two_key_layers):
    """Kept with the first such layer its policy lists, and found there whatever the order later."""
    root, _ = kit
    first = service(root, ("ckks", "secagg")).enrollment("silo-0")
    assert (root / "state" / "ckks" / "enrollment.key").exists()
    assert not (root / "state" / "secagg" / "enrollment.key").exists()
    again = service(root, ("secagg", "ckks")).enrollment("silo-0")
    assert again.public_key == first.public_key
    message = Announcement("silo-0", first.public_key, b"").message("test-consortium")
    certificate = read_certificate(root / "pki" / "silo-0.pem")
    verify(certificate, first.signature, message, context=ANNOUNCE_CONTEXT)  # with its certificate key


def test_the_key_holder_shares_only_the_key_of_the_layer_the_aggregator_runs(kit, two_key_layers):
    root, _ = kit
    keys = service(root, ("ckks", "secagg"))
    for named in (
        pb.RegisterResponse(silo_id="silo-0", key_holder="silo-1", key_layer="secagg"),  # another holder
        pb.RegisterResponse(silo_id="silo-0", key_holder="silo-0", key_layer="toy"),  # not in its policy
        pb.RegisterResponse(silo_id="silo-0"),  # a layer without a key service
    ):
        stub = KeyStub()
        keys.registered(SiloTransport(stub), named)
        keys.heartbeat(SiloTransport(stub))
        assert stub.shared == []
    stub = KeyStub()
    named = pb.RegisterResponse(silo_id="silo-0", key_holder="silo-0", key_layer="secagg")
    keys.registered(SiloTransport(stub), named)
    (shared,) = stub.shared
    current = (root / "state" / "secagg" / "current").read_text()
    assert (shared.context_id, shared.public_key) == (current, b"public of " + current.encode())
    assert not (root / "state" / "ckks" / "current").exists()
    keys.heartbeat(SiloTransport(stub))  # nobody enrolled since: nothing sealed, nothing sent
    assert len(stub.shared) == 1


def test_a_round_of_a_layer_without_a_key_service_has_no_key_to_seal_states_with(kit):
    root, _ = kit
    keys = service(root, ("secagg",))
    assert keys.keyrings == {}
    assert keys.enrollment("silo-0") is None  # nothing to announce at registration
    assert keys.secret_for("secagg") is None
    with pytest.raises(MissingKey, match="'secagg' has no key service"):
        keys.secret("secagg", None)


def with_policy(config: Path, privacy: list[str]) -> Path:
    """`config` with a policy listing `privacy` (the demo's lists its consortium's layer)."""
    tree = read_toml(config)
    tree["policy"] = {**tree.get("policy", {}), "privacy": privacy}
    config.write_text(render_toml(tree))
    return config


def test_keys_rotate_makes_a_new_key_of_the_one_layer_with_a_key_service(kit, capsys):
    _, configs = kit
    config = with_policy(configs[0], ["ckks", "secagg"])
    assert silo_main(["keys", "rotate", "--config", str(config)]) == 0
    state_dir = load_silo_config(config).path(load_silo_config(config).state_dir)
    current = (state_dir / "ckks" / "current").read_text()
    assert (state_dir / "ckks" / f"{current}.secret").exists()
    assert f"new ckks key {current[:16]}" in capsys.readouterr().out
    assert silo_main(["keys", "rotate", "--config", str(config), "--layer", "ckks"]) == 0
    assert (state_dir / "ckks" / "current").read_text() != current
    assert len(list((state_dir / "ckks").glob("*.secret"))) == 2  # the old key stays: old states open
    assert silo_main(["keys", "rotate", "--config", str(config), "--layer", "secagg"]) == 2
    assert (
        "--layer 'secagg': policy.privacy lists no such layer with a key service" in capsys.readouterr().err
    )


def test_keys_rotate_refuses_without_a_layer_with_a_key_service_or_a_choice_among_several(
    kit, capsys, monkeypatch
):
    _, configs = kit
    config = with_policy(configs[0], ["secagg"])
    assert silo_main(["keys", "rotate", "--config", str(config)]) == 2
    assert "lists no layer with a key service" in capsys.readouterr().err
    config = with_policy(configs[1], ["ckks", "secagg"])
    monkeypatch.setattr(key_service, "record", lambda name: SimpleNamespace(key_service=FAKE_KIND))
    assert silo_main(["keys", "rotate", "--config", str(config)]) == 2
    assert "several layers with a key service (ckks, secagg): name the one" in capsys.readouterr().err
    assert silo_main(["keys", "rotate", "--config", str(config), "--layer", "secagg"]) == 0
    assert "new secagg key" in capsys.readouterr().out
