"""Trust roots: a CA signature makes nobody a member; the pinned roster does, and only a quorum changes it.

The attacks are the operator's, who holds the CA key: issue a certificate for a peer id that exists (a swapped
member) or does not (a Sybil), keep using a revoked certificate, or hand silos a roster it drew up alone.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from privacy.peers import BadSignature, ConsortiumPeers
from privacy.pki.ca import init_ca, issue_server, issue_silo, revoke
from privacy.pki.errors import PkiError
from privacy.pki.identity import (
    MemberTrust,
    RevocationList,
    RevokedSerials,
    load_certificate,
    read_certificate,
    revoked_serials,
)
from privacy.pki.roster import AGGREGATOR, SILO, Roster, draft, fingerprint
from privacy.pki.signing import load_private_key, sign
from privacy.secagg.protocol import KEYS_CONTEXT
from silo.trust import SiloTrust

SILOS = ("st-marys", "city-clinic", "north-bank", "harbour")


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    """A CA, an aggregator, four silos, and the roster the enrollment kits carry."""
    root = tmp_path_factory.mktemp("roster")
    ca = root / "ca"
    init_ca(ca, name="Roster CA")
    issue_server(ca, root, hosts=["127.0.0.1"])
    for silo in SILOS:
        issue_silo(ca, root / "kits", silo_id=silo)
    roster = draft(
        "health",
        aggregator=(root / "aggregator.pem").read_bytes(),
        silos=[(s, (root / "kits" / f"{s}.pem").read_bytes()) for s in SILOS],
    )
    return root, roster


def pem(root, name: str) -> bytes:
    return (root / "kits" / f"{name}.pem").read_bytes()


def key(root, name: str) -> ec.EllipticCurvePrivateKey:
    return load_private_key(root / "kits" / f"{name}.key")


def trust(root, roster: Roster, revoked=frozenset()) -> MemberTrust:
    return MemberTrust((root / "ca" / "ca.pem").read_bytes(), roster, RevokedSerials(revoked))


def test_a_roster_round_trips_and_its_default_quorum_is_more_than_two_thirds(consortium):
    _, roster = consortium
    again = Roster.from_json(roster.to_json())
    assert again == roster
    assert again.digest() == roster.digest()
    assert roster.quorum == 3  # of 4 silos
    assert roster.silo_ids == tuple(sorted(SILOS))
    assert "sha256" in roster.describe()


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda r: replace(r, version=0), "version must be >= 1"),
        (lambda r: replace(r, quorum=5), "quorum must be between 1 and the 4 silo members"),
        (lambda r: replace(r, members=r.members + r.members[-1:]), "appears twice"),
        (lambda r: replace(r, members=r.members[1:]), "names no aggregator"),
        (
            lambda r: replace(r, members=(replace(r.members[1], role="admin"), *r.members[2:], r.members[0])),
            "role",
        ),
    ],
)
def test_a_malformed_roster_is_refused_with_its_reason(consortium, change, refusal):
    _, roster = consortium
    with pytest.raises(PkiError, match=refusal):
        change(roster)


def test_garbage_is_not_a_roster():
    with pytest.raises(PkiError, match="is not a fedlt roster"):
        Roster.from_json(b'{"consortium": "x"}')
    with pytest.raises(PkiError, match="is not a fedlt roster"):
        Roster.from_json(b"\xff")


def test_a_ca_issued_sybil_or_a_swapped_member_certificate_is_not_a_member(consortium, tmp_path):
    """The operator issues, with the CA key, a certificate for a new id and one for an existing silo's id."""
    root, roster = consortium
    members = trust(root, roster)
    members.silo(pem(root, "st-marys"), "st-marys")  # the genuine member
    issue_silo(root / "ca", tmp_path, silo_id="sybil")
    issue_silo(root / "ca", tmp_path, silo_id="st-marys", replace=True)  # the CA allows it; the roster not
    with pytest.raises(PkiError, match="does not name this certificate"):
        members.silo((tmp_path / "sybil.pem").read_bytes(), "sybil")
    with pytest.raises(PkiError, match="does not name this certificate"):
        members.silo((tmp_path / "st-marys.pem").read_bytes(), "st-marys")
    with pytest.raises(PkiError, match="does not name"):  # a member's certificate under another member's name
        members.silo(pem(root, "harbour"), "st-marys")
    with pytest.raises(PkiError, match="does not name this certificate"):  # a silo is not the aggregator
        members.aggregator(pem(root, "harbour"))
    members.aggregator((root / "aggregator.pem").read_bytes())


def test_peer_signatures_from_a_forged_or_revoked_peer_are_protocol_violations(consortium, tmp_path):
    """What a secure sum sees: keys signed by a Sybil's key, or by a member whose certificate was revoked."""
    root, roster = consortium
    issue_silo(root / "ca", tmp_path, silo_id="sybil-2")
    data = b"keys of a session"
    forged = sign(load_private_key(tmp_path / "sybil-2.key"), data, context=KEYS_CONTEXT)
    peers = ConsortiumPeers(trust(root, roster))
    with pytest.raises(BadSignature, match="sybil-2"):
        peers.verify("sybil-2", (tmp_path / "sybil-2.pem").read_bytes(), forged, data, context=KEYS_CONTEXT)
    genuine = sign(key(root, "north-bank"), data, context=KEYS_CONTEXT)
    peers.verify("north-bank", pem(root, "north-bank"), genuine, data, context=KEYS_CONTEXT)
    # revoked: the CRL the silo learned of (relayed or its own) counts from the next use, though cached
    ca_copy = tmp_path / "ca-copy"
    init_ca(ca_copy, name="unrelated")  # a CRL from another CA must not count
    revocations = RevokedSerials()
    revoking = ConsortiumPeers(MemberTrust((root / "ca" / "ca.pem").read_bytes(), roster, revocations))
    revoking.verify("north-bank", pem(root, "north-bank"), genuine, data, context=KEYS_CONTEXT)
    serial = revoke(root / "ca", silo_id="north-bank")
    revocations.add(revoked_serials((root / "ca" / "crl.pem").read_bytes(), members_ca(root), source="crl"))
    assert serial in revocations.serials
    with pytest.raises(BadSignature, match="revoked"):
        revoking.verify("north-bank", pem(root, "north-bank"), genuine, data, context=KEYS_CONTEXT)
    with pytest.raises(PkiError, match="not by the consortium CA"):
        revoked_serials((ca_copy / "crl.pem").read_bytes(), members_ca(root), source="foreign crl")


def members_ca(root):
    return read_certificate(root / "ca" / "ca.pem")


def test_expiry_is_checked_at_every_use_not_only_the_first(consortium, monkeypatch):
    root, roster = consortium
    members = trust(root, roster)
    members.silo(pem(root, "harbour"), "harbour")  # cached as issued by the CA

    class Later(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(days=3650)

    monkeypatch.setattr("privacy.pki.identity.datetime", Later)
    with pytest.raises(PkiError, match="expired"):
        members.silo(pem(root, "harbour"), "harbour")


def test_the_next_roster_needs_a_quorum_of_the_pinned_rosters_silos(consortium, tmp_path):
    """The operator alone (the aggregator's key, the CA key) cannot add a member; three of four silos can."""
    root, roster = consortium
    issue_silo(root / "ca", tmp_path, silo_id="newcomer")
    successor = draft(
        "health",
        aggregator=(root / "aggregator.pem").read_bytes(),
        silos=[*((s, pem(root, s)) for s in SILOS), ("newcomer", (tmp_path / "newcomer.pem").read_bytes())],
        previous=roster,
    )
    assert successor.version == 2
    with pytest.raises(PkiError, match="0 valid signatures"):
        roster.check_successor(successor, revocations=RevokedSerials())
    # signatures that do not count: the aggregator's, the newcomer's own, a silo signing another body
    by_operator = replace(
        successor,
        signatures={
            AGGREGATOR: sign(
                load_private_key(root / "aggregator.key"), successor.body(), context="fedlt/roster/v1"
            ),
            "newcomer": sign(
                load_private_key(tmp_path / "newcomer.key"), successor.body(), context="fedlt/roster/v1"
            ),
        },
    )
    with pytest.raises(PkiError, match="0 valid signatures"):
        roster.check_successor(by_operator, revocations=RevokedSerials())
    two = successor
    for silo in SILOS[:2]:
        two = two.signed_by(roster.member_of(cert_of(pem(root, silo)), role=SILO), key(root, silo))
    with pytest.raises(PkiError, match="2 valid signatures"):
        roster.check_successor(two, revocations=RevokedSerials())
    three = two.signed_by(roster.member_of(cert_of(pem(root, SILOS[2])), role=SILO), key(root, SILOS[2]))
    roster.check_successor(three, revocations=RevokedSerials())
    tampered = replace(three, quorum=1)  # the body changed after signing: no signature holds
    with pytest.raises(PkiError, match="0 valid signatures"):
        roster.check_successor(tampered, revocations=RevokedSerials())
    with pytest.raises(PkiError, match="not newer"):
        three.check_successor(roster, revocations=RevokedSerials())


def cert_of(raw: bytes):
    return load_certificate(raw)


def test_a_silo_pins_its_kit_roster_and_adopts_only_a_quorum_signed_successor(consortium, tmp_path):
    root, roster = consortium
    kit = tmp_path / "roster.json"
    kit.write_bytes(roster.to_json())
    state = tmp_path / "state"
    state.mkdir()
    ca_pem = (root / "ca" / "ca.pem").read_bytes()
    silo = SiloTrust(state, ca_pem=ca_pem, kit_roster=kit, crl=None)
    assert silo.roster == roster
    # the kit's file changing later does not change what is pinned
    kit.write_bytes(draft("health", aggregator=pem(root, "harbour"), silos=[]).to_json())
    assert SiloTrust(state, ca_pem=ca_pem, kit_roster=kit, crl=None).roster == roster
    unsigned = draft("health", aggregator=(root / "aggregator.pem").read_bytes(), silos=[], previous=roster)
    silo.offer_roster(unsigned.to_json())
    assert silo.roster == roster
    signed = unsigned
    for s in SILOS[:3]:
        signed = signed.signed_by(roster.member_of(cert_of(pem(root, s)), role=SILO), key(root, s))
    silo.offer_roster(signed.to_json())
    assert silo.roster == signed
    assert SiloTrust(state, ca_pem=ca_pem, kit_roster=kit, crl=None).roster == signed  # kept across restarts
    silo.offer_roster(roster.to_json())  # an older version never comes back
    assert silo.roster == signed


def test_a_silo_keeps_every_revocation_it_saw_and_an_older_crl_cannot_undo_one(consortium, tmp_path):
    _, roster = consortium
    ca = tmp_path / "ca"
    init_ca(ca, name="Roster CA 2")
    issue_silo(ca, tmp_path, silo_id="a")
    issue_silo(ca, tmp_path, silo_id="b")
    before = (ca / "crl.pem").read_bytes()
    serial = revoke(ca, silo_id="a")
    after = (ca / "crl.pem").read_bytes()
    kit = tmp_path / "roster.json"
    kit.write_bytes(roster.to_json())
    state = tmp_path / "state"
    state.mkdir()
    silo = SiloTrust(state, ca_pem=(ca / "ca.pem").read_bytes(), kit_roster=kit, crl=None)
    silo.offer_crl(after)
    silo.offer_crl(before)
    assert serial in silo.revoked.serials
    again = SiloTrust(state, ca_pem=(ca / "ca.pem").read_bytes(), kit_roster=kit, crl=None)
    assert serial in again.revoked.serials  # kept across restarts
    silo.offer_crl(b"not a crl")  # ignored with a warning, revocations intact
    assert serial in silo.revoked.serials
    assert RevocationList.load(ca / "ca.pem", ca / "crl.pem").is_revoked(
        cert_of((tmp_path / "a.pem").read_bytes())
    )


def test_fingerprints_are_of_the_whole_certificate(consortium):
    root, roster = consortium
    member = roster.member_of(cert_of(pem(root, "harbour")), role=SILO, member_id="harbour")
    assert member.fingerprint == fingerprint(cert_of(pem(root, "harbour")))
    assert len(member.fingerprint) == 64
