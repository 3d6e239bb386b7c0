import argparse
import re

import pytest

from aggregator.ca_cli import add_ca_parser, run_command
from privacy.pki.identity import read_certificate, silo_id_of


def ca(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="test")
    add_ca_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(["ca", *map(str, argv)]))


def listing(ca_dir, capsys) -> dict[str, list[str]]:
    """`ca list` as {id: [serial, kind, id, expires, revoked]} (columns: two spaces or more apart)."""
    capsys.readouterr()
    assert ca("list", "--dir", ca_dir) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", header) == ["serial", "kind", "id", "expires", "revoked"]
    return {cells[2]: cells for cells in (re.split(r"\s{2,}", row) for row in rows)}


@pytest.fixture
def ca_dir(tmp_path, capsys):
    assert ca("init", "--dir", tmp_path / "ca", "--name", "Test Consortium") == 0
    capsys.readouterr()
    return tmp_path / "ca"


def test_the_ca_commands_end_to_end(tmp_path, capsys):
    ca_dir, out = tmp_path / "ca", tmp_path / "pki"
    assert ca("init", "--dir", ca_dir, "--name", "Test Consortium") == 0
    printed = capsys.readouterr().out
    for name in ("ca.pem", "ca.key", "crl.pem", "issued.json"):
        assert str(ca_dir / name) in printed
    assert (
        ca("issue-server", "--dir", ca_dir, "--out", out, "--host", "127.0.0.1", "--host", "localhost") == 0
    )
    assert ca("issue-silo", "--dir", ca_dir, "--out", out, "--silo-id", "st-marys") == 0
    assert ca("issue-silo", "--dir", ca_dir, "--out", out, "--silo-id", "city-clinic") == 0
    printed = capsys.readouterr().out
    assert str(out / "city-clinic.key") in printed
    assert "send" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "aggregator.key",
        "aggregator.pem",
        "city-clinic.key",
        "city-clinic.pem",
        "st-marys.key",
        "st-marys.pem",
    ]
    assert silo_id_of(read_certificate(out / "st-marys.pem")) == "st-marys"

    rows = listing(ca_dir, capsys)
    assert set(rows) == {"aggregator", "st-marys", "city-clinic"}
    assert [rows[i][1] for i in ("aggregator", "st-marys")] == ["server", "silo"]
    assert all(row[4] == "-" for row in rows.values())

    assert ca("revoke", "--dir", ca_dir, "--silo-id", "city-clinic") == 0
    assert rows["city-clinic"][0] in capsys.readouterr().out
    rows = listing(ca_dir, capsys)
    assert rows["city-clinic"][4].endswith("UTC")
    assert rows["st-marys"][4] == "-"


def test_revoke_by_serial_accepts_openssl_style_colons(ca_dir, tmp_path, capsys):
    assert ca("issue-operator", "--dir", ca_dir, "--out", tmp_path / "pki") == 0
    serial = listing(ca_dir, capsys)["operator"][0]
    even = serial.zfill(len(serial) + len(serial) % 2)
    with_colons = ":".join(even[i : i + 2] for i in range(0, len(even), 2))
    assert ca("revoke", "--dir", ca_dir, "--serial", with_colons) == 0
    assert listing(ca_dir, capsys)["operator"][4] != "-"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("issue-silo", "--silo-id", "not ok", "--out", "OUT"),
            "invalid silo id 'not ok': use 1 to 64 letters",
        ),
        (("init", "--name", "Again"), "already holds a CA"),
        (("revoke", "--silo-id", "nobody"), "silo 'nobody' has no live certificate"),
        (("issue-server", "--host", "host:50051", "--out", "OUT"), "invalid host 'host:50051'"),
    ],
)
def test_a_user_error_is_one_message_and_exit_code_2(ca_dir, tmp_path, capsys, argv, message):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert ca(argv[0], "--dir", ca_dir, *argv[1:]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.count("\n") == 1


def test_commands_on_a_directory_without_a_ca_say_so(tmp_path, capsys):
    assert ca("list", "--dir", tmp_path / "nowhere") == 2
    assert "no consortium CA in" in capsys.readouterr().err


def test_a_file_system_error_is_a_message_too(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a directory")
    assert ca("init", "--dir", tmp_path / "taken", "--name", "X") == 2
    assert "File exists" in capsys.readouterr().err


def test_issue_silo_names_the_certificate_and_the_roster_step_next(ca_dir, tmp_path, capsys):
    """The walkthrough read "issued silo 'st-marys''s" and a next step that skipped the roster, without
    which the aggregator admits no silo and no silo pins anything."""
    out = tmp_path / "pki"
    assert ca("issue-silo", "--dir", ca_dir, "--out", out, "--silo-id", "st-marys") == 0
    printed = capsys.readouterr().out
    assert "''s" not in printed
    assert "issued a certificate for silo 'st-marys', serial" in printed
    assert "python -m aggregator roster draft --consortium <id> --aggregator <aggregator.pem>" in printed
    assert f"--silo st-marys={out / 'st-marys.pem'}" in printed
    assert printed.index("roster draft") < printed.index("over a channel you trust")
    assert "roster.json" in printed.split("over a channel you trust")[0]
