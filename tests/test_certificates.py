"""Certificates over a consortium's life: expiry warnings, renewal beside the live certificate, rotation of a
silo's certificate on a running secure consortium (a roster change by quorum), revocation of the old one, and
a clear error for each step taken out of order.

The guarantees are written failure first: a renewed certificate is refused until a quorum-signed roster names
it, a revocation takes effect on the running consortium without a restart, and revoking the old certificate
before the roster names the new one is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.__main__ import main as aggregator_main
from aggregator.service import ConsortiumServicer, Identity
from aggregator.status import render as render_status
from aggregator.status_page import _warnings
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import operator_pb2, operator_pb2_grpc, round_pb2
from privacy.pki.ca import (
    PkiError,
    init_ca,
    issue_server,
    issue_silo,
    list_issued,
    renew_ca,
    renew_silo,
    revoke,
)
from privacy.pki.identity import MemberTrust, RevocationList, read_certificate, verify_chain
from privacy.pki.renewal import ExpiryWatch, Watched, certificate_request, expiry_warnings
from privacy.pki.roster import SILO, Roster, RosterFile, draft
from privacy.pki.signing import load_private_key
from silo.__main__ import main as silo_main
from silo.trust import OwnCertificate, SiloTrust, switch_due
from tests.consortium_harness import Consortium, channel, code_of, register, write_kit
from tests.test_consortium import assert_same_model, simulated_state

CODE = grpc.StatusCode


def roster_of(certs: Path, silos: list[str], aggregator: Path, **options) -> Roster:
    return draft(
        "clinics",
        aggregator=aggregator.read_bytes(),
        silos=[(s, (certs / f"{s}.pem").read_bytes()) for s in silos],
        **options,
    )


def signed_by(roster: Roster, previous: Roster, keys: dict[str, Path]) -> Roster:
    for silo_id, key in keys.items():
        roster = roster.signed_by(previous.member(silo_id), load_private_key(key))
    return roster


# --- the CA: renewal beside the live certificate, and revocation in the right order --------------------


def test_a_renewal_stands_beside_the_live_certificate_until_the_roster_names_it(tmp_path):
    ca, old, new = tmp_path / "ca", tmp_path / "old", tmp_path / "new"
    init_ca(ca, name="Clinics CA")
    issue_server(ca, tmp_path, hosts=["127.0.0.1"])
    first = issue_silo(ca, old, silo_id="a")
    first_cert = read_certificate(first.certificate)  # its file is overwritten below
    issue_silo(ca, old, silo_id="b")
    with pytest.raises(PkiError, match="write the renewal to another --out directory"):
        renew_silo(ca, old, silo_id="a")  # the files of the certificate still in use are never overwritten
    renewed = renew_silo(ca, new, silo_id="a")
    assert renewed.renews == first.serial
    crl = RevocationList.load(ca / "ca.pem", ca / "crl.pem")
    assert not crl.is_revoked(read_certificate(first.certificate)), "the old certificate must keep working"
    assert {r.serial for r in list_issued(ca) if r.subject_id == "a" and r.revoked_at is None} == {
        first.serial,
        renewed.serial,
    }
    with pytest.raises(PkiError, match="already has a renewed certificate"):
        renew_silo(ca, tmp_path / "third", silo_id="a")
    with pytest.raises(PkiError, match="name the one to revoke with --serial"):
        revoke(ca, silo_id="a")

    in_force = roster_of(old, ["a", "b"], tmp_path / "aggregator.pem")
    # out of order: the roster in force still names the old certificate, or the roster is not given
    with pytest.raises(PkiError, match="give --roster"):
        revoke(ca, serial=first.serial)
    with pytest.raises(PkiError, match=r"roster v1 still names certificate .* for 'a'"):
        revoke(ca, serial=first.serial, roster=in_force)
    assert not RevocationList.load(ca / "ca.pem", ca / "crl.pem").is_revoked(
        read_certificate(first.certificate)
    )

    shutil.copy(new / "a.pem", old / "a.pem")
    successor = roster_of(old, ["a", "b"], tmp_path / "aggregator.pem", previous=in_force)
    assert revoke(ca, serial=first.serial, roster=successor) == first.serial
    crl = RevocationList.load(ca / "ca.pem", ca / "crl.pem")
    assert crl.is_revoked(first_cert)
    assert not crl.is_revoked(read_certificate(renewed.certificate))
    # expelling a member is still one command, and a deliberate override exists
    assert revoke(ca, silo_id="b")
    second = renew_silo(ca, tmp_path / "again", silo_id="a")
    assert revoke(ca, serial=renewed.serial, expel=True) == renewed.serial
    assert second.renews == renewed.serial


def test_a_certificate_request_renews_the_certificate_of_a_key_the_silo_keeps(tmp_path):
    ca = tmp_path / "ca"
    init_ca(ca, name="Clinics CA")
    issued = issue_silo(ca, tmp_path / "kit", silo_id="st-marys")
    key = load_private_key(issued.key)
    renewed = renew_silo(ca, tmp_path / "new", silo_id="st-marys", csr=certificate_request(key, "st-marys"))
    assert renewed.key is None
    assert not (tmp_path / "new" / "st-marys.key").exists()
    cert = read_certificate(renewed.certificate)
    assert cert.public_key() == key.public_key()
    verify_chain(cert, read_certificate(ca / "ca.pem"))
    forged = bytearray(certificate_request(ec.generate_private_key(ec.SECP256R1()), "st-marys"))
    forged[-80] ^= 1  # inside the signature's base64: the request no longer proves the key
    with pytest.raises(PkiError, match="request"):
        renew_silo(ca, tmp_path / "forged", silo_id="st-marys", csr=bytes(forged))
    other = ec.generate_private_key(ec.SECP256R1())
    enrolled = issue_silo(ca, tmp_path / "own", silo_id="harbour", csr=certificate_request(other, "harbour"))
    assert enrolled.key is None
    assert read_certificate(enrolled.certificate).public_key() == other.public_key()


def test_the_silo_and_ca_commands_renew_a_certificate_for_the_key_the_silo_keeps(tmp_path, capsys):
    configs = write_kit(tmp_path)
    pki = tmp_path / "pki"
    request = tmp_path / "silo-2.csr"
    assert silo_main(["certificate-request", "--config", str(configs[2]), "--out", str(request)]) == 0
    assert "which stays in" in capsys.readouterr().out
    renewing = ["ca", "renew-silo", "--dir", str(pki / "ca"), "--out", str(tmp_path / "new"), "--csr"]
    assert aggregator_main([*renewing, str(request), "--silo-id", "silo-2"]) == 0
    printed = capsys.readouterr().out
    assert "private key" not in printed
    renewed = read_certificate(tmp_path / "new" / "silo-2.pem")
    assert renewed.public_key() == load_private_key(pki / "silo-2.key").public_key()

    # enrollment without the key ever leaving the silo: the request makes the key
    fresh = tmp_path / "fresh.toml"
    fresh.write_text(
        configs[2].read_text().replace("silo-2.key", "fresh.key").replace("silo-2.pem", "fresh.pem")
    )
    asking = ["certificate-request", "--config", str(fresh), "--out", str(tmp_path / "fresh.csr")]
    assert silo_main(asking) == 2
    assert "give this silo's id with --silo-id" in _one_error_line(capsys.readouterr())
    assert silo_main([*asking, "--silo-id", "fresh"]) == 0
    assert (pki / "fresh.key").stat().st_mode & 0o077 == 0
    issuing = [
        "ca",
        "issue-silo",
        "--dir",
        str(pki / "ca"),
        "--out",
        str(tmp_path / "kit"),
        "--silo-id",
        "fresh",
    ]
    assert aggregator_main([*issuing, "--csr", str(tmp_path / "fresh.csr")]) == 0
    issued = read_certificate(tmp_path / "kit" / "fresh.pem")
    assert issued.public_key() == load_private_key(pki / "fresh.key").public_key()
    assert not (tmp_path / "kit" / "fresh.key").exists()


def test_a_renewed_ca_certificate_keeps_every_issued_certificate_and_crl_valid(tmp_path):
    ca = tmp_path / "ca"
    init_ca(ca, name="Short-lived CA", days=10)
    old = read_certificate(ca / "ca.pem")
    silo = issue_silo(ca, tmp_path, silo_id="a")
    revoke(ca, silo_id="a")
    renew_ca(ca, days=3650)
    new = read_certificate(ca / "ca.pem")
    assert new.not_valid_after_utc > old.not_valid_after_utc + timedelta(days=3000)
    assert new.subject == old.subject
    assert new.public_key() == old.public_key()
    verify_chain(read_certificate(silo.certificate), new)
    assert RevocationList.load(ca / "ca.pem", ca / "crl.pem").is_revoked(read_certificate(silo.certificate))
    assert (ca / f"ca-{old.serial_number:x}.pem").exists()


# --- expiry warnings ---------------------------------------------------------------------------------------


def test_expiry_warnings_name_the_certificate_its_date_and_what_renews_it(tmp_path, caplog):
    ca = tmp_path / "ca"
    init_ca(ca, name="Clinics CA", days=40)
    soon = issue_silo(ca, tmp_path, silo_id="soon", days=10)
    later = issue_silo(ca, tmp_path, silo_id="later", days=35)
    past = datetime.now(UTC) - timedelta(days=30)
    gone = issue_silo(ca, tmp_path, silo_id="gone", valid_from=past, days=20)
    watched = [
        Watched(f"silo {name}'s certificate", read_certificate(p.certificate), f"renew-{name}")
        for name, p in (("later", later), ("soon", soon), ("gone", gone))
    ]
    warnings = expiry_warnings(watched, within_days=30)
    assert len(warnings) == 2  # "later" expires after the window
    assert warnings[0].startswith("silo gone's certificate")
    assert "expired on" in warnings[0]
    expires = read_certificate(soon.certificate).not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")
    assert f"expires on {expires}, in 9 days; to renew it: renew-soon" in warnings[1]
    assert expiry_warnings(watched, within_days=40)[-1].startswith("silo later's")
    assert "in 34 days" in expiry_warnings(watched, within_days=40)[-1]

    watch = ExpiryWatch(lambda: watched, within_days=30, problems=lambda: ["the roster is short"])
    with caplog.at_level(logging.WARNING, logger="privacy.pki.renewal"):
        assert watch.check() == ["the roster is short", *warnings]
        watch.check()  # nothing new: nothing logged again
    assert [r.getMessage() for r in caplog.records] == ["the roster is short", *warnings]


def test_the_operators_views_list_the_warnings_escaped():
    warning = "silo <b>'s certificate (serial 1a) expires on 2030-01-01 00:00 UTC, in 9 days; to renew it: …"
    text = render_status(operator_pb2.StatusResponse(consortium_id="c", certificate_warnings=[warning]))
    assert f"  ! {warning}" in text.splitlines()
    assert "<li>silo &lt;b&gt;&#x27;s certificate" in _warnings([warning])
    assert _warnings([]) == ""


def test_ca_list_shows_days_left(tmp_path, capsys):
    ca = tmp_path / "ca"
    init_ca(ca, name="Clinics CA")
    issue_silo(ca, tmp_path, silo_id="a", days=20)
    assert aggregator_main(["ca", "list", "--dir", str(ca)]) == 0
    assert "(19 days left)" in capsys.readouterr().out


# --- the roster: a renewed certificate is a roster change by quorum -----------------------------------


def test_a_renewed_certificate_is_no_member_until_a_quorum_signed_roster_names_it(tmp_path, caplog):
    ca, kit = tmp_path / "ca", tmp_path / "kit"
    init_ca(ca, name="Clinics CA")
    issue_server(ca, tmp_path, hosts=["127.0.0.1"])
    silos = ["a", "b", "c"]
    for s in silos:
        issue_silo(ca, kit, silo_id=s)
    v1 = roster_of(kit, silos, tmp_path / "aggregator.pem")
    renewed = read_certificate(renew_silo(ca, tmp_path / "new", silo_id="b").certificate)
    with pytest.raises(PkiError, match="does not name this certificate") as refused:
        v1.member_of(renewed, role=SILO, member_id="b")
    assert "it names another certificate" in str(refused.value)
    assert "roster draft --previous" in str(refused.value)

    shutil.copy(tmp_path / "new" / "b.pem", tmp_path / "b-new.pem")
    v2 = draft(
        "clinics",
        aggregator=(tmp_path / "aggregator.pem").read_bytes(),
        silos=[
            ("a", (kit / "a.pem").read_bytes()),
            ("b", (tmp_path / "b-new.pem").read_bytes()),
            ("c", (kit / "c.pem").read_bytes()),
        ],
        previous=v1,
    )
    path = tmp_path / "roster.json"
    path.write_bytes(v1.to_json())
    served = RosterFile(path)
    short = signed_by(v2, v1, {"a": kit / "a.key"})
    with caplog.at_level(logging.ERROR, logger="privacy.pki.roster"):
        os.replace(_written(tmp_path / "short.json", short.to_json()), path)
        assert served.current() == short  # served all the same: the operator may be on the way
    assert "1 valid signatures" in served.problem
    assert "it needs 3" in served.problem
    assert "python -m aggregator roster check" in caplog.text
    whole = signed_by(v2, v1, {s: kit / f"{s}.key" for s in silos})
    os.replace(_written(tmp_path / "whole.json", whole.to_json()), path)
    assert served.current() == whole
    assert served.problem == ""
    assert whole.member_of(renewed, role=SILO, member_id="b").id == "b"
    path.write_bytes(whole.to_json()[:100])  # a copy caught half-way: the last good roster stays in force
    assert served.current() == whole
    assert "not a fedlt roster" in served.problem


def test_a_silo_switches_to_a_renewed_pair_only_once_it_is_whole_and_its_roster_names_it(tmp_path):
    write_kit(tmp_path)
    pki = tmp_path / "pki"
    ca_pem = (pki / "ca" / "ca.pem").read_bytes()
    state = tmp_path / "state"
    state.mkdir()
    trust = SiloTrust(state, ca_pem=ca_pem, kit_roster=pki / "roster.json", crl=None)
    own = OwnCertificate(pki / "silo-1.pem", pki / "silo-1.key", ca_pem, ca_path=pki / "ca" / "ca.pem")
    running = own.read()
    assert own.renewed(running) is None
    assert not switch_due(trust, running, None)

    renewed = renew_silo(pki / "ca", tmp_path / "new", silo_id="silo-1")
    install(renewed.certificate, pki / "silo-1.pem")  # the certificate first: not the key's yet
    assert own.renewed(running) is None
    install(renewed.key, pki / "silo-1.key")
    pending = own.renewed(running)
    assert pending is not None
    assert pending.cert.serial_number == renewed.serial
    assert not switch_due(trust, running, pending), "peers holding roster v1 would refuse it"
    v1 = trust.roster
    v2 = draft(
        v1.consortium,
        aggregator=v1.member("aggregator", role="aggregator").certificate,
        silos=[(s, pending.cert_pem if s == "silo-1" else v1.member(s).certificate) for s in v1.silo_ids],
        previous=v1,
    )
    v2 = signed_by(v2, v1, {"silo-0": pki / "silo-0.key", "silo-2": pki / "silo-2.key"})  # 2 of 3
    assert not trust.offer_roster(v2.to_json())
    assert not switch_due(trust, running, pending)
    v2 = v2.signed_by(v1.member("silo-1"), running.key)  # the running key signs the roster that retires it
    assert trust.offer_roster(v2.to_json())
    assert switch_due(trust, running, pending)


class _Caller:
    """What a servicer reads of a call: the verified client certificate."""

    def __init__(self, pem: bytes) -> None:
        self.pem = pem

    def auth_context(self) -> dict:
        return {"x509_pem_cert": [self.pem]}

    def abort(self, code, details):
        raise AssertionError(f"refused: {code} {details}")


def test_a_running_silo_is_offered_a_newer_roster_and_crl_until_it_holds_them(tmp_path):
    """Heartbeat replies carry the roster and CRL only when the silo's differ; a RoundSpec carries the
    roster to a silo whose last heartbeat named another, so that it checks the round's peers with it."""
    write_kit(tmp_path)
    pki = tmp_path / "pki"
    identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
    roster = RosterFile(pki / "roster.json")
    engine = SimpleNamespace(heartbeat=lambda *args: None)
    store = SimpleNamespace(touch_silo=lambda silo, privacy_remaining=None: None)
    servicer = ConsortiumServicer(
        engine,
        store,
        identity,
        b"",
        members=MemberTrust((pki / "ca" / "ca.pem").read_bytes(), roster, identity.revocations),
        roster=roster,
        relay=None,
        submit_seconds=10.0,
    )
    caller = _Caller((pki / "silo-0.pem").read_bytes())
    v1, crl = roster.current(), (pki / "ca" / "crl.pem").read_bytes()
    holding = pb.HeartbeatRequest(roster_sha256=v1.digest(), crl_sha256=hashlib.sha256(crl).hexdigest())
    reply = servicer.Heartbeat(holding, caller)
    assert (reply.roster, reply.crl) == (b"", b"")
    spec = pb.JoinResponse(round_spec=round_pb2.SignedRoundSpec(spec=b"s"))
    assert not servicer._with_roster("silo-0", spec).roster

    v2 = draft(
        v1.consortium,
        aggregator=v1.member("aggregator", role="aggregator").certificate,
        silos=[(m.id, m.certificate) for m in v1.members if m.role == SILO],
        previous=v1,
    )
    os.replace(_written(tmp_path / "v2.json", v2.to_json()), pki / "roster.json")
    revoke(pki / "ca", silo_id="silo-2")
    reply = servicer.Heartbeat(holding, caller)
    assert reply.roster == (pki / "roster.json").read_bytes()
    assert reply.crl == (pki / "ca" / "crl.pem").read_bytes()
    offered = servicer._with_roster("silo-0", spec)
    assert offered.roster == reply.roster
    assert not spec.roster, "the directive other silos share is left as it was"
    assert not servicer._with_roster("silo-0", pb.JoinResponse(abort=pb.Abort(round_id="r"))).roster
    now = pb.HeartbeatRequest(roster_sha256=v2.digest(), crl_sha256=hashlib.sha256(reply.crl).hexdigest())
    reply = servicer.Heartbeat(now, caller)
    assert (reply.roster, reply.crl) == (b"", b"")
    assert not servicer._with_roster("silo-0", spec).roster


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    time.sleep(0.01)  # a distinct modification time, as a replaced file has
    return path


# --- clear errors at the command line ----------------------------------------------------------------------


def _one_error_line(captured) -> str:
    assert captured.err.startswith("error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def test_an_expired_aggregator_or_silo_certificate_stops_its_cli_with_one_line(tmp_path, capsys):
    configs = write_kit(tmp_path)
    pki = tmp_path / "pki"
    past = datetime.now(UTC) - timedelta(days=60)
    issue_server(pki / "ca", pki, hosts=["127.0.0.1"], valid_from=past, days=30, replace=True)
    assert aggregator_main(["serve", "--config", str(tmp_path / "consortium.toml")]) == 2
    err = _one_error_line(capsys.readouterr())
    assert "the aggregator's certificate" in err
    assert "expired on" in err
    assert "ca renew-server" in err
    assert not (tmp_path / "aggregator-data" / "listening.json").exists()

    issue_silo(pki / "ca", pki, silo_id="silo-0", valid_from=past, days=30, replace=True)
    assert silo_main(["run", "--config", str(configs[0])]) == 2
    err = _one_error_line(capsys.readouterr())
    assert "this silo's certificate" in err
    assert "expired on" in err


def test_an_expired_ca_stops_both_clis_with_one_line(tmp_path, capsys, monkeypatch):
    configs = write_kit(tmp_path)

    class Later(datetime):  # eleven years on: the CA (ten years) has expired
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(days=4000)

    monkeypatch.setattr("privacy.pki.identity.datetime", Later)
    assert aggregator_main(["serve", "--config", str(tmp_path / "consortium.toml")]) == 2
    assert "the consortium CA certificate" in _one_error_line(capsys.readouterr())
    assert silo_main(["run", "--config", str(configs[0])]) == 2
    err = _one_error_line(capsys.readouterr())
    assert "the consortium CA certificate" in err
    assert "expired on" in err


def test_the_cli_refuses_a_roster_with_too_few_signatures_and_a_revocation_out_of_order(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    renewing = ["ca", "renew-silo", "--dir", str(pki / "ca"), "--out", str(tmp_path / "new")]
    assert aggregator_main([*renewing, "--silo-id", "silo-1"]) == 0
    old_serial = read_certificate(pki / "silo-1.pem").serial_number
    printed = capsys.readouterr().out
    assert f"serial {old_serial:x}, stays valid" in printed
    assert f"ca revoke --dir <CA directory> --serial {old_serial:x} --roster next.json" in printed
    nxt = tmp_path / "next.json"
    silos = [f"--silo=silo-{k}={pki / f'silo-{k}.pem'}" for k in (0, 2)]
    silos.append(f"--silo=silo-1={tmp_path / 'new' / 'silo-1.pem'}")
    args = ["roster", "draft", "--consortium", "clinics", "--aggregator", str(pki / "aggregator.pem"), *silos]
    assert aggregator_main([*args, "--previous", str(pki / "roster.json"), "--out", str(nxt)]) == 0
    assert silo_main(["roster", "sign", "--config", str(configs[0]), str(nxt)]) == 0
    capsys.readouterr()
    check = ["roster", "check", "--previous", str(pki / "roster.json"), str(nxt)]
    assert aggregator_main(check) == 2
    err = _one_error_line(capsys.readouterr())
    assert "carries 1 valid signatures" in err
    assert "it needs 3" in err

    revoking = ["ca", "revoke", "--dir", str(pki / "ca"), "--serial", f"{old_serial:x}"]
    assert aggregator_main(revoking) == 2
    assert "give --roster" in _one_error_line(capsys.readouterr())
    assert aggregator_main([*revoking, "--roster", str(pki / "roster.json")]) == 2
    assert "roster v1 still names certificate" in _one_error_line(capsys.readouterr())

    # a silo that installed its renewed certificate (a new key) before signing is told what to do
    shutil.copy(tmp_path / "new" / "silo-1.pem", pki / "silo-1.pem")
    shutil.copy(tmp_path / "new" / "silo-1.key", pki / "silo-1.key")
    assert silo_main(["roster", "sign", "--config", str(configs[1]), str(nxt)]) == 2
    assert "sign a draft before installing a renewed certificate" in _one_error_line(capsys.readouterr())


# --- rotation on a running consortium ---------------------------------------------------------------------


def wait_for_count(consortium: Consortium, k: int, text: str, count: int, timeout: float = 180) -> None:
    log = consortium.directory / f"silo-{k}.log"
    until = time.monotonic() + timeout
    while (log.read_text() if log.exists() else "").count(text) < count:
        if time.monotonic() > until:
            raise AssertionError(f"silo-{k} did not log {text!r} {count} times within {timeout} s")
        time.sleep(0.1)


def operator_status(consortium: Consortium) -> operator_pb2.StatusResponse:
    with channel(consortium, "operator") as ch:
        return operator_pb2_grpc.OperatorServiceStub(ch).Status(operator_pb2.StatusRequest(), timeout=10)


def install(source: Path, target: Path) -> None:
    """As an administrator replaces a file: a copy next to it, renamed over it."""
    staged = target.with_name(f".{target.name}.new")
    shutil.copy(source, staged)
    os.replace(staged, target)


@pytest.fixture
def rotating(tmp_path):
    consortium = Consortium.create(
        tmp_path / "c", rounds=500, min_silos=3, round_timeout=30.0, stage_timeout=10.0
    )
    pki = consortium.directory / "pki"
    # silo-0's certificate expires in 10 days: the kit roster names it, so both ends warn from the start
    issue_silo(pki / "ca", pki, silo_id="silo-0", days=10, replace=True)
    kit = Roster.read(pki / "roster.json")
    (pki / "roster.json").write_bytes(
        draft(
            kit.consortium,
            aggregator=(pki / "aggregator.pem").read_bytes(),
            silos=[(s, (pki / f"{s}.pem").read_bytes()) for s in kit.silo_ids],
        ).to_json()
    )
    yield consortium
    consortium.stop()


@pytest.mark.slow  # 30-70 s; every step of it is also a test of its own in the default run
def test_a_silos_certificate_is_rotated_on_a_running_secure_consortium(rotating, tmp_path, capsys):
    c = rotating
    pki = c.directory / "pki"
    ca, renewed, old = pki / "ca", tmp_path / "renewed", tmp_path / "old"
    c.start()
    c.wait_for_round(1)
    warned = c.wait_for_output(lambda line: "silo silo-0's certificate on roster v1" in line, timeout=10)
    assert "in 9 days; to renew it: `python -m aggregator ca renew-silo" in warned
    assert "silo-0`" in warned
    c.wait_for_silo_log(0, "this silo's certificate")
    assert "python -m silo certificate-request" in (c.directory / "silo-0.log").read_text()
    assert any("silo silo-0's certificate" in w for w in operator_status(c).certificate_warnings)

    # 1. the CA holder renews silo-1's certificate; the old one stays valid
    old.mkdir()
    for name in ("silo-1.pem", "silo-1.key"):
        shutil.copy2(pki / name, old / name)
    old_serial = read_certificate(old / "silo-1.pem").serial_number
    renew = ["ca", "renew-silo", "--dir", str(ca), "--out", str(renewed), "--silo-id", "silo-1"]
    assert aggregator_main(renew) == 0
    assert f"--serial {old_serial:x}" in capsys.readouterr().out

    # failure first: the renewed certificate is refused while the roster in force names the old one
    with channel(c, "silo-1", ca_dir=renewed) as ch:
        code, details = code_of(lambda: register(ch))
    assert code == CODE.PERMISSION_DENIED
    assert "does not name this certificate" in details
    assert "it names another certificate" in details

    # 2. roster v2 names the renewed certificate; every silo of v1 signs it (with its key in use)
    nxt = tmp_path / "next.json"
    members = [f"--silo=silo-{k}={pki / f'silo-{k}.pem'}" for k in (0, 2)]
    members.append(f"--silo=silo-1={renewed / 'silo-1.pem'}")
    drafting = [
        "roster",
        "draft",
        "--consortium",
        "test-consortium",
        "--aggregator",
        str(pki / "aggregator.pem"),
    ]
    assert (
        aggregator_main([*drafting, *members, "--previous", str(pki / "roster.json"), "--out", str(nxt)]) == 0
    )
    for config in c.silo_configs:
        assert silo_main(["roster", "sign", "--config", str(config), str(nxt)]) == 0
    assert aggregator_main(["roster", "check", "--previous", str(pki / "roster.json"), str(nxt)]) == 0

    # 3. silo-1's administrator installs the renewed files; the agent keeps the running certificate for now
    install(renewed / "silo-1.key", pki / "silo-1.key")
    install(renewed / "silo-1.pem", pki / "silo-1.pem")
    c.wait_for_silo_log(1, "roster v1 does not name yet: keeping the running one")
    installed = max(c.committed())
    c.wait_for_round(installed + 1)
    assert "silo-1" in c.committed()[installed + 1]
    # failure first: revoking the old certificate before the roster names the new one is refused
    revoking = [
        "ca",
        "revoke",
        "--dir",
        str(ca),
        "--serial",
        f"{old_serial:x}",
        "--roster",
        str(pki / "roster.json"),
    ]
    assert aggregator_main(revoking) == 2
    assert "still names certificate" in capsys.readouterr().err
    with channel(c, "silo-1", ca_dir=old) as ch:
        assert register(ch).silo_id == "silo-1"  # the old certificate still works

    # 4. the operator puts v2 in force; running silos adopt it, silo-1 switches without anyone restarting
    install(nxt, pki / "roster.json")
    for k in (0, 2):
        c.wait_for_silo_log(k, "adopted roster v2")
    c.wait_for_silo_log(1, "switching to the renewed certificate")
    wait_for_count(c, 1, "registered as silo-1", 2)
    switched = max(c.committed())
    c.wait_for_round(switched + 1)
    with channel(c, "silo-1", ca_dir=old) as ch:
        code, details = code_of(lambda: register(ch))
    assert code == CODE.PERMISSION_DENIED
    assert "does not name this certificate" in details

    # 5. the old certificate is revoked: refused from the next call, running silos learn of it, no restart
    assert aggregator_main(revoking) == 0
    with channel(c, "silo-1", ca_dir=old) as ch:
        code, details = code_of(lambda: register(ch))
    assert code == CODE.PERMISSION_DENIED
    assert "revoked" in details
    for k in (0, 2):
        c.wait_for_silo_log(k, "revocations now known: 2 certificates")  # silo-0's replaced one, and this
    revoked = max(c.committed())
    # two rounds after the revocation: with the one after the switch, three after the new certificate's
    # registration, whatever round was in flight when each step came
    c.wait_for_round(revoked + 2)
    assert all(process.poll() is None for process in c.silos.values()), "no silo stopped"

    c.kill(c.aggregator)
    committed = c.committed()
    assert list(committed) == list(range(max(committed) + 1)), "no round lost or repeated"
    assert all(committed[r] == ["silo-0", "silo-1", "silo-2"] for r in committed if r > 0)
    store = c.store()
    try:
        store.verify_audit()
        log = store.audit_log()
    finally:
        store.close()
    rounds = [r.detail["round"] for r in log if r.event == "round_committed"]
    assert rounds == sorted(set(rounds)) == list(range(1, max(committed) + 1))
    (changed,) = [r for r in log if r.event == "silo_certificate_changed"]
    assert changed.detail["silo"] == "silo-1"
    after = [r for r in log if r.seq > changed.seq]
    assert any(r.event == "contribution_accepted" and r.detail.get("silo") == "silo-1" for r in after)
    assert sum(r.event == "round_committed" for r in after) >= 3  # the rotated silo counted with its new key
    # never a wrong model: the state after all this is the simulator's, bit for bit in its rounds
    assert_same_model(c.final_state(), simulated_state(tmp_path, rounds=max(committed)))
    text = "\n".join(c.output) + "".join((c.directory / f"silo-{k}.log").read_text() for k in range(3))
    assert "Traceback" not in text
