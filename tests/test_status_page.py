"""The aggregator's status page: what it shows, that it escapes what silos and the log say, that it only
reads, and who may read it (HTTP on loopback only; over HTTPS, unrevoked operator certificates only)."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.status_page import StatusPage, operator_tls, snapshot
from aggregator.store import AuditKey, Store
from privacy.pki.ca import init_ca, issue_operator, issue_server, issue_silo, revoke
from privacy.pki.identity import RevocationList

AUDIT_KEY = AuditKey(b"fedlt tests' fixed audit key ...")
HOSTILE = "<script>alert(1)</script>"
ABOUT = {"consortium_id": "st-test", "method": "creff", "privacy": "secagg", "total_rounds": 5}


def _status(silos: list[dict]) -> dict:
    return {
        "committed_rounds": 2,
        "stage": "training",
        "round_id": "r3.a1.x",
        "deadline_ms": 0,
        "participants": ["alpha", "beta"],
        "submitted": ["alpha"],
        "state_digest": "ab" * 32,
        "silos": silos,
    }


SILOS = [
    {"silo_id": "alpha", "connected": True, "last_seen_unix_ms": 1, "activity": "training"},
    {"silo_id": "beta", "connected": False, "last_seen_unix_ms": 0, "activity": "offline"},
]
for silo in SILOS:
    silo["last_contributed_round"] = 2


@pytest.fixture
def pki(tmp_path) -> Path:
    ca = tmp_path / "ca"
    init_ca(ca, name="test CA")
    issue_server(ca, tmp_path, hosts=["127.0.0.1"])
    issue_operator(ca, tmp_path, name="operator")
    issue_silo(ca, tmp_path, silo_id="alpha")
    return tmp_path


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    s.save_initial_state("d0", b"w")
    for r in (1, 2):
        _, round_id = s.begin_attempt(r, ["alpha", "beta"], f"n{r}")
        s.commit_round(round_number=r, round_id=round_id, digest=f"d{r}", data=b"w", contributors=["alpha"])
        s.save_metrics(r, {"round": r, "accuracy": 0.5 + r / 10, "few": r / 10, "many": 0.9})
    s.audit("operator_note", {"text": HOSTILE})
    yield s
    s.close()


@pytest.fixture
def page(store, pki):
    served = StatusPage("127.0.0.1:0", lambda: snapshot(_status(SILOS), ABOUT, store), _revocations(pki))
    yield served.start()
    served.stop()


def _revocations(pki: Path) -> RevocationList:
    return RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem")


def _get(page: StatusPage, path: str = "/", method: str = "GET") -> http.client.HTTPResponse:
    host, port = page.server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request(method, path)
    return connection.getresponse()


def test_the_page_shows_rounds_silos_accuracy_and_the_verified_chain(page, store):
    response = _get(page)
    assert response.status == 200
    text = response.read().decode()
    assert "<strong>2 of 5</strong> rounds committed" in text
    assert "creff over secagg" in text
    assert "r3.a1.x" in text
    assert "1 of 2 contributions" in text
    for silo_id in ("alpha", "beta"):
        assert f"<td>{silo_id}</td>" in text
    assert "<polyline" in text
    assert "overall 70.0%" in text
    assert "few-shot 20.0%" in text
    records = len(store.audit_log())
    assert f"Hash chain verified over all {records} records." in text


def test_what_silos_and_the_log_say_is_escaped(store, pki):
    hostile = [{**SILOS[0], "silo_id": HOSTILE, "activity": HOSTILE}]
    page = StatusPage("127.0.0.1:0", lambda: snapshot(_status(hostile), ABOUT, store), _revocations(pki))
    page.start()
    try:
        text = _get(page).read().decode()
    finally:
        page.stop()
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_an_edited_audit_record_shows_the_chain_broken(page, store):
    store._db.execute("DROP TRIGGER audit_no_update")  # someone with the file, not the key
    store._db.execute("UPDATE audit SET detail = '{}' WHERE event = 'operator_note'")
    text = _get(page).read().decode()
    assert "Hash chain broken" in text
    assert "operator_note" in text
    assert json.loads(_get(page, "/status.json").read())["audit"]["verified"] is False


def test_the_json_has_the_facts_of_the_page(page, store):
    response = _get(page, "/status.json")
    assert response.headers["Content-Type"] == "application/json"
    facts = json.loads(response.read())
    assert facts["committed_rounds"] == 2
    assert [m["accuracy"] for m in facts["metrics"]] == [pytest.approx(0.6), pytest.approx(0.7)]
    assert facts["audit"]["verified"] is True
    assert facts["audit"]["recent"][0]["event"] == "operator_note"  # newest first


def test_the_page_only_reads(page):
    for method in ("POST", "PUT", "DELETE", "HEAD"):
        response = _get(page, "/", method)
        assert response.status == 405, method
        assert response.headers["Allow"] == "GET"
    assert _get(page, "/../consortium.sqlite").status == 404
    headers = _get(page).headers
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Cache-Control"] == "no-store"


def test_a_page_without_tls_is_refused_off_loopback(store, pki):
    with pytest.raises(ValueError, match="not a loopback address"):
        StatusPage("0.0.0.0:0", dict, _revocations(pki))


def _https(page: StatusPage, pki: Path, name: str | None) -> tuple[int, str]:
    client = ssl.create_default_context(cafile=pki / "ca" / "ca.pem")
    if name is not None:
        client.load_cert_chain(pki / f"{name}.pem", pki / f"{name}.key")
    host, port = page.server.server_address[:2]
    connection = http.client.HTTPSConnection(host, port, timeout=30, context=client)
    connection.request("GET", "/")
    response = connection.getresponse()
    return response.status, response.read().decode()


def test_over_https_only_an_unrevoked_operator_reads_the_page(store, pki):
    tls = operator_tls(pki / "aggregator.pem", pki / "aggregator.key", pki / "ca" / "ca.pem")
    revocations = _revocations(pki)
    page = StatusPage("127.0.0.1:0", lambda: snapshot(_status(SILOS), ABOUT, store), revocations, tls)
    page.start()
    try:
        assert page.url.startswith("https://127.0.0.1:")
        status, text = _https(page, pki, "operator")
        assert status == 200
        assert "Consortium st-test" in text
        status, text = _https(page, pki, "alpha")
        assert status == 403
        assert "only operators" in text
        with pytest.raises((ssl.SSLError, ConnectionError)):  # no certificate: the handshake fails
            _https(page, pki, None)
        revoke(pki / "ca", serial=_serial(pki / "operator.pem"))
        status, text = _https(page, pki, "operator")
        assert status == 403
        assert "revoked" in text
    finally:
        page.stop()


def _serial(path: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def test_a_stalled_client_does_not_block_the_page(page):
    """A connection that never sends its request holds its own thread, not the server's."""
    host, port = page.server.server_address[:2]
    with socket.create_connection((host, port), timeout=30):
        assert _get(page).status == 200


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_a_headless_browser_renders_the_page(page, tmp_path):
    """The page as a browser builds it: the silo table, the chart and the chain's verdict in the DOM."""
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert '<table id="silos">' in dom
    assert "<polyline" in dom
    assert "Hash chain verified" in dom


def test_a_served_aggregator_names_its_page_in_listening_json(tmp_path):
    """End to end: `python -m aggregator serve` with `[server] status_page` (the demo's consortium.toml sets
    it on loopback) serves it before any silo joins."""
    from tests.consortium_harness import ENV, write_kit

    write_kit(tmp_path, silos=2)
    config = tmp_path / "consortium.toml"
    assert 'status_page = "127.0.0.1:0"' in config.read_text()
    process = subprocess.Popen(
        [sys.executable, "-m", "aggregator", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("status page (read-only): "):
                break
        listening = json.loads((tmp_path / "aggregator-data" / "listening.json").read_text())
        url = listening["status_page"]
        assert line.strip().endswith(url)
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/")
        text = connection.getresponse().read().decode()
        assert "<strong>0 of" in text
        assert "Hash chain verified" in text
    finally:
        process.terminate()
        process.wait(timeout=60)
