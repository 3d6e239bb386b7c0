"""The roster as people handle it: the operator drafts, silo administrators check and sign, silos adopt."""

from __future__ import annotations

from aggregator.__main__ import main as aggregator_main
from privacy.pki.ca import issue_silo
from privacy.pki.roster import Roster
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
