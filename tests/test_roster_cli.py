"""The roster as people handle it: the operator drafts, silo administrators check and sign, silos adopt."""

from __future__ import annotations

import pytest

from aggregator.__main__ import main as aggregator_main
from privacy.pki.ca import issue_silo, renew_silo, revoke
from privacy.pki.renewal import certificate_request
from privacy.pki.roster import Roster
from privacy.pki.signing import load_private_key
from silo.__main__ import main as silo_main
from silo.trust import SiloTrust
from tests.consortium_harness import write_kit


def test_a_member_is_added_by_a_draft_a_quorum_of_silos_signs(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    assert silo_main(["roster", "show", "--config", str(configs[0])]) == 0
    shown = capsys.readouterr().out
    assert "roster v1 of consortium 'clinics'" in shown
    assert shown.count("sha256") == 5  # the body, the aggregator and three silos

    issue_silo(pki / "ca", pki, silo_id="newcomer")
    silos = [f"--silo=silo-{k}={pki / f'silo-{k}.pem'}" for k in range(3)]
    draft_path = tmp_path / "roster-v2.json"
    args = ["roster", "draft", "--consortium", "clinics", "--aggregator", str(pki / "aggregator.pem")]
    args += [*silos, f"--silo=newcomer={pki / 'newcomer.pem'}", "--previous", str(pki / "roster.json")]
    assert aggregator_main([*args, "--out", str(draft_path)]) == 0
    assert "3 silos of v1 sign it" in capsys.readouterr().out

    state = tmp_path / "silo-0-state"
    state.mkdir(exist_ok=True)
    trust = SiloTrust(
        state, ca_pem=(pki / "ca" / "ca.pem").read_bytes(), kit_roster=pki / "roster.json", crl=None
    )
    for k in range(3):
        trust.offer_roster(draft_path.read_bytes())
        assert trust.roster.version == 1, f"adopted with {k} signatures"
        assert silo_main(["roster", "sign", "--config", str(configs[k]), str(draft_path)]) == 0
    assert "3 signatures now; v1 needs 3" in capsys.readouterr().out
    trust.offer_roster(draft_path.read_bytes())
    assert trust.roster.version == 2
    assert "newcomer" in trust.roster.silo_ids


def test_signing_refuses_a_draft_that_cannot_follow_the_pinned_roster(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    same = tmp_path / "same.json"
    same.write_bytes((tmp_path / "pki" / "roster.json").read_bytes())
    assert silo_main(["roster", "sign", "--config", str(configs[0]), str(same)]) == 2
    assert "can only sign a later version of the same consortium" in capsys.readouterr().err
    assert Roster.read(same).signatures == {}
    assert (
        aggregator_main(["roster", "draft", "--consortium", "x", "--aggregator", "nowhere.pem", "--out", "x"])
        == 2
    )
    assert "error:" in capsys.readouterr().err


def _next_draft(tmp_path, capsys, *options: str) -> tuple[int, str]:
    """The operator's `roster draft` of v2, adding a newcomer to the kit's three silos."""
    pki = tmp_path / "pki"
    if not (pki / "newcomer.pem").exists():
        issue_silo(pki / "ca", pki, silo_id="newcomer")
    args = ["roster", "draft", "--consortium", "clinics", "--aggregator", str(pki / "aggregator.pem")]
    args += [f"--silo=silo-{k}={pki / f'silo-{k}.pem'}" for k in range(3)]
    args += [f"--silo=newcomer={pki / 'newcomer.pem'}", "--previous", str(pki / "roster.json")]
    code = aggregator_main([*args, *options, "--out", str(tmp_path / "roster-v2.json")])
    return code, capsys.readouterr()


def test_roster_check_counts_no_signer_the_ca_revoked_when_given_the_crl(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    assert _next_draft(tmp_path, capsys)[0] == 0
    for config in configs:
        assert silo_main(["roster", "sign", "--config", str(config), str(tmp_path / "roster-v2.json")]) == 0
    revoke(pki / "ca", silo_id="silo-2", expel=True)
    check = ["roster", "check", "--previous", str(pki / "roster.json")]
    capsys.readouterr()
    assert aggregator_main([*check, str(tmp_path / "roster-v2.json")]) == 0
    assert "revocations were not checked: give --ca and --crl" in capsys.readouterr().out
    crl = ["--ca", str(pki / "ca" / "ca.pem"), "--crl", str(pki / "ca" / "crl.pem")]
    assert aggregator_main([*check, *crl, str(tmp_path / "roster-v2.json")]) == 2
    err = capsys.readouterr().err
    assert "carries 2 valid signatures" in err
    assert "it needs 3; not counted: silo-2 (its certificate CN=silo-2" in err
    assert "has been revoked" in err
    assert (
        aggregator_main([*check, "--crl", str(pki / "ca" / "crl.pem"), str(tmp_path / "roster-v2.json")]) == 2
    )
    assert "--ca and --crl go together" in capsys.readouterr().err


def test_a_quorum_silos_refuse_is_refused_when_drafted_and_when_signed(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    code, out = _next_draft(tmp_path, capsys, "--quorum", "2")
    assert code == 2
    assert "has quorum 2 of its 4 silos, not above 1/2 of them (that takes 3)" in out.err
    assert "draft it with --quorum 3 or more" in out.err
    assert not (tmp_path / "roster-v2.json").exists(), "nothing written"
    code, out = _next_draft(
        tmp_path, capsys, "--quorum", "2", "--quorum-above", "1/3"
    )  # silos lowered theirs
    assert code == 0, out.err
    assert silo_main(["roster", "sign", "--config", str(configs[0]), str(tmp_path / "roster-v2.json")]) == 2
    err = capsys.readouterr().err
    assert "not signing" in err
    assert "as this silo's policy.roster_quorum_above asks" in err
    assert Roster.read(tmp_path / "roster-v2.json").signatures == {}
    with pytest.raises(SystemExit):
        _next_draft(tmp_path, capsys, "--quorum-above", "1")
    assert "a fraction from 0 up to (not including) 1" in capsys.readouterr().err


def _rows(shown: str) -> dict[str, str]:
    """`silo roster show`'s member rows by id."""
    rows = [line.split() for line in shown.splitlines() if "sha256" in line and "(body" not in line]
    return {words[words.index("sha256") - 1]: " ".join(words) for words in rows}


def test_roster_show_marks_this_silos_row_and_finds_its_certificate_there(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    assert silo_main(["roster", "show", "--config", str(configs[1])]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["silo-1"].startswith("* ")
    assert rows["silo-1"].endswith("(this silo)")
    assert not any(row.startswith("* ") for silo, row in rows.items() if silo != "silo-1")
    assert "this silo, silo-1: its certificate" in out
    assert "is the one the roster names" in out


def test_roster_show_refuses_a_certificate_the_roster_does_not_name_for_this_silo(tmp_path, capsys):
    """A silo whose certificate was reissued after the roster was drafted is refused by the aggregator and
    every peer: its administrator learns it here, not from a silo that never joins."""
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    issue_silo(pki / "ca", pki, silo_id="silo-0", replace=True)  # over the files silo-0.toml names
    assert silo_main(["roster", "show", "--config", str(configs[0])]) == 1
    shown = capsys.readouterr()
    assert _rows(shown.out)["silo-0"].startswith("* ")
    assert "roster v1 of 'clinics' names another certificate for silo-0" in shown.err
    assert str(pki / "silo-0.pem") in shown.err


def test_roster_show_refuses_a_silo_the_roster_does_not_name(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    issue_silo(pki / "ca", pki, silo_id="newcomer")
    config = configs[0].read_text().replace("pki/silo-0.", "pki/newcomer.")
    configs[0].write_text(config)
    assert silo_main(["roster", "show", "--config", str(configs[0])]) == 1
    shown = capsys.readouterr()
    assert not any(row.startswith("* ") for row in _rows(shown.out).values())
    assert "roster v1 of 'clinics' names no silo 'newcomer'" in shown.err


def test_roster_show_says_a_renewal_of_the_same_key_counts_once_a_roster_names_it(tmp_path, capsys):
    configs = write_kit(tmp_path, consortium_id="clinics")
    pki = tmp_path / "pki"
    csr = certificate_request(load_private_key(pki / "silo-0.key"), "silo-0")
    renewed = renew_silo(pki / "ca", tmp_path / "renewed", silo_id="silo-0", csr=csr)
    (pki / "silo-0.pem").write_bytes(renewed.certificate.read_bytes())
    assert silo_main(["roster", "show", "--config", str(configs[0])]) == 1
    assert "it renews the same key, and counts once a roster naming it is in force" in capsys.readouterr().err
