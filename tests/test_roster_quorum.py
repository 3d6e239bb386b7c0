"""The roster quorum counts valid, distinct, unrevoked members, and a silo refuses a quorum below its floor.

The attacks are the operator's, who holds the CA key and may hold an expelled member's key too: have a revoked
or expired member's key sign a roster that adds Sybils (who then count as colluders toward c >= 2t - n), list
one certificate (or one key) under two ids so that it votes twice, or enroll silos with a roster a single
silo can replace.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.pki.ca import init_ca, issue_server, issue_silo, revoke
from privacy.pki.errors import PkiError
from privacy.pki.identity import RevocationList, RevokedSerials
from privacy.pki.renewal import certificate_request
from privacy.pki.roster import (
    DEFAULT_QUORUM_ABOVE,
    Member,
    Roster,
    RosterFile,
    default_quorum,
    draft,
)
from privacy.pki.signing import load_private_key
from silo.agent import SiloAgent
from silo.config import PolicySection, load_silo_config
from silo.trust import SiloTrust
from tests.consortium_harness import write_kit

SILOS = ("alpha", "bravo", "charlie", "delta")


class Pki:
    """A CA, an aggregator and four silos, with the roster v1 their kits carry (quorum 3 of 4)."""

    def __init__(self, root):
        self.root = root
        self.ca = root / "ca"
        init_ca(self.ca, name="Quorum CA")
        issue_server(self.ca, root, hosts=["127.0.0.1"])
        for silo in SILOS:
            issue_silo(self.ca, root, silo_id=silo)
        self.v1 = self.roster(SILOS)

    def pem(self, name: str) -> bytes:
        return (self.root / f"{name}.pem").read_bytes()

    def roster(self, silos, **options) -> Roster:
        return draft(
            "health",
            aggregator=self.pem("aggregator"),
            silos=[(s, self.pem(s)) for s in silos],
            **options,
        )

    def signed(self, roster: Roster, by, *, pinned: Roster) -> Roster:
        for silo in by:
            roster = roster.signed_by(pinned.member(silo), load_private_key(self.root / f"{silo}.key"))
        return roster

    def with_sybils(self, pinned: Roster, **options) -> Roster:
        """The next version, adding two CA-issued Sybils the operator controls."""
        for sybil in ("sybil-1", "sybil-2"):
            issue_silo(self.ca, self.root, silo_id=sybil)
        return draft(
            "health",
            aggregator=self.pem("aggregator"),
            silos=[(m.id, m.certificate) for m in pinned.members if m.role == "silo"]
            + [(s, self.pem(s)) for s in ("sybil-1", "sybil-2")],
            previous=pinned,
            **options,
        )

    def silo(self, kit: Roster, tmp_path, **options) -> SiloTrust:
        path = tmp_path / "kit-roster.json"
        path.write_bytes(kit.to_json())
        state = tmp_path / "state"
        state.mkdir(exist_ok=True)
        return SiloTrust(state, ca_pem=(self.ca / "ca.pem").read_bytes(), kit_roster=path, **options)


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path / "pki")


# --- revoked and expired members do not vote -----------------------------------------------------------


def test_an_expelled_members_signature_does_not_help_adopt_a_roster_adding_sybils(pki, tmp_path, caplog):
    """delta is expelled (revoked); the operator kept its key and has two silos sign: 2 + delta = 3."""
    silo = pki.silo(pki.v1, tmp_path, crl=None)
    revoke(pki.ca, silo_id="delta", expel=True)
    silo.offer_crl((pki.ca / "crl.pem").read_bytes())
    sybils = pki.signed(pki.with_sybils(pki.v1), ("alpha", "bravo", "delta"), pinned=pki.v1)
    with caplog.at_level(logging.WARNING, logger="silo"):
        assert not silo.offer_roster(sybils.to_json())
    assert silo.roster == pki.v1
    assert "2 valid signatures" in caplog.text
    assert "not counted: delta (its certificate CN=delta" in caplog.text
    assert "has been revoked" in caplog.text
    with pytest.raises(PkiError, match="it needs 3"):
        pki.v1.check_successor(sybils, revocations=silo.revoked)
    pki.v1.check_successor(sybils, revocations=RevokedSerials())  # the same signatures before expulsion


def test_a_revocation_in_the_silos_own_crl_file_counts_though_the_aggregator_withholds_it(pki, tmp_path):
    silo = pki.silo(pki.v1, tmp_path, crl=pki.ca / "crl.pem")
    revoke(pki.ca, silo_id="delta", expel=True)  # after the silo started; the aggregator relays no CRL
    sybils = pki.signed(pki.with_sybils(pki.v1), ("alpha", "bravo", "delta"), pinned=pki.v1)
    assert not silo.offer_roster(sybils.to_json())
    assert silo.roster == pki.v1


def test_an_expired_members_signature_does_not_count(pki, tmp_path):
    long_ago = datetime.now(UTC) - timedelta(days=30)
    issue_silo(pki.ca, pki.root, silo_id="delta", valid_from=long_ago, days=1, replace=True)
    v1 = pki.roster(SILOS)
    silo = pki.silo(v1, tmp_path, crl=None)
    sybils = pki.signed(pki.with_sybils(v1), ("alpha", "bravo", "delta"), pinned=v1)
    assert not silo.offer_roster(sybils.to_json())
    assert silo.roster == v1
    with pytest.raises(PkiError, match=r"2 valid signatures.*delta \(its certificate .* expired on"):
        v1.check_successor(sybils, revocations=RevokedSerials())
    whole = pki.signed(sybils, ("charlie",), pinned=v1)
    assert silo.offer_roster(whole.to_json()), "three members with valid certificates are a quorum"


# --- one certificate, one key, one vote ------------------------------------------------------------------


def test_one_certificate_under_two_ids_would_vote_twice_and_is_refused_by_name(pki, tmp_path):
    """charlie's certificate listed again as charlie-twin: a quorum of 3 of 4 ids, reached by alpha and
    charlie signing twice."""
    members = [*pki.v1.members, Member("charlie-twin", "silo", pki.pem("charlie"))]
    with pytest.raises(PkiError, match="charlie and charlie-twin are listed with the same certificate"):
        replace(pki.v1, members=tuple(members))
    kit = tmp_path / "kit.json"
    kit.write_bytes(_raw_roster_with_twin(pki))
    state = tmp_path / "state"
    state.mkdir()
    with pytest.raises(PkiError, match="same certificate"):
        SiloTrust(state, ca_pem=(pki.ca / "ca.pem").read_bytes(), kit_roster=kit, crl=None)
    assert not (state / "roster.json").exists(), "nothing pinned"


def _raw_roster_with_twin(pki: Pki) -> bytes:
    """The operator's file, written by hand: delta's slot holds charlie's certificate as charlie-twin."""
    tree = json.loads(pki.v1.to_json())
    for m in tree["members"]:
        if m["id"] == "delta":
            m["id"], m["certificate"] = "charlie-twin", pki.pem("charlie").decode()
    return json.dumps(tree).encode()


def test_one_key_under_two_ids_is_refused_though_the_certificates_differ(pki):
    """The CA issues charlie's key (from a request) a second certificate under another id."""
    key = load_private_key(pki.root / "charlie.key")
    issue_silo(pki.ca, pki.root / "twin", silo_id="charlie-twin", csr=certificate_request(key, "charlie"))
    twin = (pki.root / "twin" / "charlie-twin.pem").read_bytes()
    assert twin != pki.pem("charlie")
    silos = [*((s, pki.pem(s)) for s in SILOS[:3]), ("charlie-twin", twin)]
    with pytest.raises(PkiError, match="charlie and charlie-twin are listed with the same public key"):
        draft("health", aggregator=pki.pem("aggregator"), silos=silos)


def test_the_aggregators_certificate_is_no_silos_either(pki):
    with pytest.raises(PkiError, match="same certificate"):
        draft("health", aggregator=pki.pem("alpha"), silos=[(s, pki.pem(s)) for s in SILOS])


# --- the quorum floor --------------------------------------------------------------------------------------


def test_a_kit_roster_that_one_silo_could_replace_is_not_pinned(pki, tmp_path):
    weak = pki.roster(SILOS[:3], quorum=1)
    with pytest.raises(PkiError) as refused:
        pki.silo(weak, tmp_path, crl=None)
    message = str(refused.value)
    for part in ("roster v1 of 'health'", "quorum 1 of its 3 silos", "1/2", "policy.roster_quorum_above"):
        assert part in message, message
    assert "--quorum 2" in message, "the fix: a roster drafted with a quorum the floor accepts"
    assert not (tmp_path / "state" / "roster.json").exists()
    lowered = pki.silo(weak, tmp_path, crl=None, quorum_above=Fraction(0))  # the administrator's choice
    assert lowered.roster == weak


def test_the_agent_stops_on_a_weak_kit_roster_and_starts_once_its_administrator_lowers_the_floor(tmp_path):
    configs = write_kit(tmp_path)
    kit = tmp_path / "pki" / "roster.json"
    kit.write_bytes(replace(Roster.read(kit), quorum=1).to_json())
    with pytest.raises(PkiError, match=r"not pinning the enrollment kit's roster .* quorum 1 of its 3 silos"):
        SiloAgent(load_silo_config(configs[0]))
    text = configs[0].read_text()
    configs[0].write_text(text.replace("[policy]\n", '[policy]\nroster_quorum_above = "0"\n', 1))
    assert SiloAgent(load_silo_config(configs[0])).trust.roster.quorum == 1


def test_a_pinned_roster_below_a_raised_floor_stops_the_silo_at_start(pki, tmp_path):
    pki.silo(pki.v1, tmp_path, crl=None)  # 3 of 4 > 1/2
    with pytest.raises(PkiError, match=r"pinned .*quorum 3 of its 4 silos.*3/4"):
        pki.silo(pki.v1, tmp_path, crl=None, quorum_above=Fraction(3, 4))


def test_a_successor_that_lowers_the_quorum_below_the_floor_is_not_adopted(pki, tmp_path, caplog):
    """Signed by a genuine quorum, but it would let one silo sign every later version."""
    silo = pki.silo(pki.v1, tmp_path, crl=None)
    weak = pki.signed(pki.with_sybils(pki.v1, quorum=1), ("alpha", "bravo", "charlie"), pinned=pki.v1)
    with caplog.at_level(logging.WARNING, logger="silo"):
        assert not silo.offer_roster(weak.to_json())
    assert silo.roster == pki.v1
    assert "quorum 1 of its 6 silos" in caplog.text


@pytest.mark.parametrize("silos", range(41))
def test_the_drafted_default_quorum_passes_the_default_floor(silos):
    """Down to consortia of one and two silos, whose default quorum is every silo."""
    quorum = default_quorum(silos)
    assert quorum > DEFAULT_QUORUM_ABOVE * silos
    assert quorum > Fraction(2, 3) * silos or silos == 0
    assert quorum <= max(silos, 1)


def test_the_default_floor_is_the_silo_policys_default():
    assert Fraction(PolicySection().roster_quorum_above) == DEFAULT_QUORUM_ABOVE


# --- the aggregator counts as silos do ---------------------------------------------------------------------


def test_the_aggregator_says_silos_will_refuse_a_roster_only_a_revoked_member_completes(pki, tmp_path):
    path = tmp_path / "served.json"
    path.write_bytes(pki.v1.to_json())
    revoke(pki.ca, silo_id="delta", expel=True)
    served = RosterFile(path, revocations=RevocationList.load(pki.ca / "ca.pem", pki.ca / "crl.pem"))
    sybils = pki.signed(pki.with_sybils(pki.v1), ("alpha", "bravo", "delta"), pinned=pki.v1)
    path.write_bytes(sybils.to_json())
    assert served.current() == sybils  # served all the same: the operator may be on the way
    assert "2 valid signatures" in served.problem
    assert "revoked" in served.problem


def test_the_aggregator_says_silos_refuse_a_roster_below_the_default_floor(pki, tmp_path):
    path = tmp_path / "served.json"
    path.write_bytes(pki.roster(SILOS[:3], quorum=1).to_json())
    served = RosterFile(path)
    assert "silos will neither pin nor adopt it" in served.problem
    assert "quorum 1 of its 3 silos" in served.problem
    assert "draft it again with --quorum 2 or more" in served.problem
    path.write_bytes(pki.v1.to_json())
    served = RosterFile(path)
    assert served.problem == ""
    weak = pki.signed(pki.with_sybils(pki.v1, quorum=1), ("alpha", "bravo", "charlie"), pinned=pki.v1)
    path.write_bytes(weak.to_json())
    assert served.current() == weak
    assert "which silos holding v1 will not adopt" in served.problem
    assert "quorum 1 of its 6 silos, not above 1/2 of them (that takes 4)" in served.problem


# --- the property: adoption iff valid distinct signers reach the quorum --------------------------------

STATUSES = ("valid", "revoked", "expired", "not-yet-valid", "unsigned", "other-body")
_NOW = datetime.now(UTC)
_WINDOWS = {
    "expired": (_NOW - timedelta(days=30), _NOW - timedelta(days=1)),
    "not-yet-valid": (_NOW + timedelta(days=1), _NOW + timedelta(days=30)),
}


def _certificate(name: str, status: str) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    """A self-signed stand-in: the quorum asks only the pinned certificate's key, dates and serial."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _WINDOWS.get(status, (_NOW - timedelta(days=1), _NOW + timedelta(days=30)))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), key


_POOL = {(k, s): _certificate(f"s{k}", s) for k in range(6) for s in STATUSES}
_AGGREGATOR = _certificate("aggregator", "valid")[0]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_successor_is_adopted_iff_its_valid_distinct_unrevoked_signers_reach_the_quorum(data):
    statuses = data.draw(st.lists(st.sampled_from(STATUSES), min_size=1, max_size=6), label="statuses")
    quorum = data.draw(st.integers(1, len(statuses)), label="quorum")
    ids = [f"s{k}" for k in range(len(statuses))]
    pool = [_POOL[k, s] for k, s in enumerate(statuses)]
    pinned = Roster(
        "p",
        1,
        quorum,
        (
            Member("aggregator", "aggregator", _AGGREGATOR),
            *(Member(i, "silo", pem) for i, (pem, _) in zip(ids, pool, strict=True)),
        ),
    )
    successor = replace(pinned, version=2, signatures={})
    elsewhere = replace(pinned, version=3, signatures={})
    revoked = RevokedSerials()
    for i, status, (_, key) in zip(ids, statuses, pool, strict=True):
        member = pinned.member(i)
        if status == "revoked":
            revoked.add(frozenset({member.cert.serial_number}))
        if status == "other-body":
            signature = elsewhere.signed_by(member, key).signatures[i]
            successor = replace(successor, signatures={**successor.signatures, i: signature})
        elif status != "unsigned":
            successor = successor.signed_by(member, key)
    counted = statuses.count("valid")
    if counted >= quorum:
        pinned.check_successor(successor, revocations=revoked)
    else:
        with pytest.raises(PkiError, match=f"carries {counted} valid signatures"):
            pinned.check_successor(successor, revocations=revoked)


# --- one state directory, several agents (a silo in several studies) -----------------------------------


def test_two_studies_agents_never_roll_the_pinned_roster_back_on_disk(pki, tmp_path):
    """Each study's agent keeps the silo's one pinned roster. One adopts v2, the other, still holding v1 in
    memory, then adopts v3 — or is offered v2 again — and must not write an older roster over a newer one: a
    rollback on disk would trust again, after a restart, a member a later roster removed."""
    first, second = (pki.silo(pki.v1, tmp_path, crl=None) for _ in range(2))
    v2 = pki.signed(pki.roster(SILOS, previous=pki.v1), SILOS[:3], pinned=pki.v1)
    v3 = pki.signed(pki.roster(SILOS[:3], previous=v2), SILOS[:3], pinned=v2)
    assert first.offer_roster(v2.to_json())
    assert first.offer_roster(v3.to_json())
    second.offer_roster(v2.to_json())  # the aggregator replays the older successor to the other agent
    pinned = Roster.read(tmp_path / "state" / "roster.json")
    assert pinned.version == 3, f"the pinned roster went back to v{pinned.version}"
    assert second.current().version == 3  # and the other agent took the newer roster from the disk


def test_two_studies_agents_keep_each_others_revocations(pki, tmp_path):
    """The aggregator relays an older CRL to one study's agent after the other took a newer one: the file
    keeps both agents' revocations (a lost one would make a revoked member's certificate count again)."""
    first, second = (pki.silo(pki.v1, tmp_path, crl=None) for _ in range(2))
    revoke(pki.ca, silo_id="alpha")
    older = (pki.ca / "crl.pem").read_bytes()
    revoke(pki.ca, silo_id="bravo")
    first.offer_crl((pki.ca / "crl.pem").read_bytes())
    second.offer_crl(older)
    saved = json.loads((tmp_path / "state" / "revoked.json").read_text())["serials"]
    assert len(saved) == 2, saved
