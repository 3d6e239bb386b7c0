"""Errors that say where and why (issue 31): a silo names the address it dialled and what the failure likely
means, stops at once with exit 2 when its kit does not trust the aggregator (retrying would meet the same
certificate), and the aggregator logs who it refused and why.

A real aggregator runs for the module; silo agents run in this process, waited on through their log
records, or, where the exit code is the point, as `python -m silo run`.
"""

from __future__ import annotations

import http.server
import logging
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from aggregator.demo import point_silos_at
from privacy.pki.ca import issue_silo, revoke
from silo.agent import SiloAgent
from silo.config import SiloConfig, load_silo_config
from silo.tls_probe import ConnectionProblem, UntrustedAggregator, server_certificate
from tests.consortium_harness import ENV, Consortium, channel, code_of, register, write_kit

UNTRUSTED = "the aggregator's certificate is not the one the pinned roster names"
NOT_GRPC = "does not speak TLS/gRPC: is it the status page or another service?"
# generous bounds for a busy machine: each ends the wait as soon as the awaited event happens
AGENT_SECONDS = 120
LOG_SECONDS = 60


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Consortium]:
    consortium = Consortium.create(
        tmp_path_factory.mktemp("errors"), rounds=1, min_silos=1, silos=1, privacy="plaintext"
    )
    consortium.start_aggregator()
    yield consortium
    consortium.stop()


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> list[Path]:
    """A silo's kit of another consortium: its own CA (`privacy.pki.ca.init_ca`), roster and certificate."""
    return write_kit(tmp_path_factory.mktemp("elsewhere"), silos=1, consortium_id="another-consortium")


def aimed(path: Path, address: str, name: str) -> SiloConfig:
    """The silo config at `path`, dialling `address`, with a state folder of its own (an agent locks its
    folder for as long as this process lives)."""
    config = load_silo_config(path)
    return replace(
        config, state_dir=f"{name}-state", connection=replace(config.connection, aggregator=address)
    )


class Said(logging.Handler):
    """Sets `seen` when the silo logs a record holding `text`."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.seen = threading.Event()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.records.append(message)
        if self.text in message:
            self.seen.set()


def agent_says(config: SiloConfig, text: str) -> list[str]:
    """Run the agent until it logs `text`, then stop it; its warnings up to then."""
    said = Said(text)
    logger = logging.getLogger("silo")
    logger.addHandler(said)
    stop = threading.Event()
    agent = SiloAgent(config, stop=stop)
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    try:
        assert said.seen.wait(LOG_SECONDS), f"the agent did not log {text!r}; it logged {said.records}"
    finally:
        stop.set()
        runner.join(AGENT_SECONDS)
        logger.removeHandler(said)
    assert not runner.is_alive()
    return said.records


@contextmanager
def closed_port() -> Iterator[int]:
    """A port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextmanager
def http_listener() -> Iterator[int]:
    """A plain HTTP server, as a status page on a loopback address is."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *_: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def probe(live: Consortium, certificate: Path, key: Path, **options) -> bytes:
    pki = live.directory / "pki"
    return server_certificate(
        live.address,
        server_name=options.get("server_name", ""),
        ca_pem=options.get("ca", pki / "ca" / "ca.pem").read_bytes(),
        certificate=certificate,
        key=key,
    )


def test_a_kit_of_another_consortium_exits_2_at_its_first_attempt(live, elsewhere):
    """The attack on the walkthrough: a silo whose kit (CA, roster, certificate) is another consortium's,
    pointed at this aggregator. Its CA does not vouch for the aggregator's certificate, so no attempt can
    succeed: the agent exits 2 naming the address and what to check, without a retry."""
    point_silos_at(live.address, elsewhere)
    done = subprocess.run(
        [sys.executable, "-m", "silo", "run", "--config", str(elsewhere[0])],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=AGENT_SECONDS,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"error: {UNTRUSTED}: the TLS server at {live.address}" in done.stderr
    assert "connection.ca and connection.roster" in done.stderr
    assert "retrying" not in output


def test_the_probe_refuses_a_certificate_issued_for_another_name(live):
    """An aggregator certificate from this silo's CA, but not for the name dialled, is no aggregator to it."""
    pki = live.directory / "pki"
    with pytest.raises(UntrustedAggregator, match=re.escape(UNTRUSTED)) as refused:
        probe(live, pki / "silo-0.pem", pki / "silo-0.key", server_name="elsewhere.example")
    assert "is not issued for 'elsewhere.example'" in str(refused.value)
    assert probe(live, pki / "silo-0.pem", pki / "silo-0.key") == (pki / "aggregator.pem").read_bytes()


def test_an_aggregator_refusing_the_silos_certificate_is_named_as_such(live, elsewhere):
    """The silo trusts the aggregator, but the aggregator's CA did not issue the silo's certificate: gRPC
    says only "Socket closed"; the probe says the aggregator does not accept this certificate."""
    certificate = elsewhere[0].parent / "pki" / "silo-0.pem"
    closed = re.escape(f"the aggregator at {live.address} closed the connection after the TLS handshake")
    with pytest.raises(ConnectionProblem, match=closed):
        probe(live, certificate, certificate.with_suffix(".key"))


def test_a_closed_port_is_named_as_nothing_listening(live):
    with closed_port() as port:
        address = f"127.0.0.1:{port}"
        config = aimed(live.silo_configs[0], address, "closed")
        warnings = agent_says(config, f"nothing listens at {address}")
    assert "is the aggregator running" in warnings[-1]
    assert warnings[-1].endswith("retrying in 1 s")


def test_a_plain_http_listener_is_named_as_not_speaking_tls(live):
    """The walkthrough's WRONG_VERSION_NUMBER: the silo pointed at the status page's port."""
    with http_listener() as port:
        address = f"127.0.0.1:{port}"
        warnings = agent_says(aimed(live.silo_configs[0], address, "http"), f"{address} {NOT_GRPC}")
    assert "WRONG_VERSION_NUMBER" in warnings[-1]


def test_an_unresolvable_host_is_named(live):
    with pytest.raises(ConnectionProblem, match=re.escape("cannot resolve 'aggregator.invalid'")):
        server_certificate(
            "aggregator.invalid:50051",
            server_name="",
            ca_pem=(live.directory / "pki" / "ca" / "ca.pem").read_bytes(),
            certificate=live.directory / "pki" / "silo-0.pem",
            key=live.directory / "pki" / "silo-0.key",
        )


def test_the_aggregator_logs_who_it_refused_and_why(live, tmp_path):
    """A certificate the CA issued but the roster does not name, and a revoked one: each refusal is one
    aggregator line naming the caller's address, its certificate and the reason."""
    issue_silo(live.directory / "pki" / "ca", tmp_path, silo_id="sybil")
    with channel(live, "sybil", ca_dir=tmp_path) as ch:
        code_of(lambda: register(ch))
    line = live.wait_for_output(lambda text: "refused a registration from" in text, LOG_SECONDS)
    assert "ipv4:127.0.0.1:" in line
    assert "CN=sybil" in line
    assert "does not name this certificate" in line

    live.enroll("leaving", tmp_path)
    revoke(live.directory / "pki" / "ca", silo_id="leaving")
    with channel(live, "leaving", ca_dir=tmp_path) as ch:
        code_of(lambda: register(ch))
    line = live.wait_for_output(lambda text: "revoked" in text and "CN=leaving" in text, LOG_SECONDS)
    assert "refused /fedlt.v1.ConsortiumService/Register from ipv4:127.0.0.1:" in line


def test_an_aggregator_address_without_a_port_exits_2_naming_the_setting(tmp_path):
    """A mistake in silo.toml no retry mends: said once, before any dial (it was a ValueError's traceback
    from the connection probe, at every retry)."""
    (config,) = write_kit(tmp_path, silos=1)[:1]
    config.write_text(config.read_text().replace('"ADDRESS"', '"aggregator.example.org"'))
    done = subprocess.run(
        [sys.executable, "-m", "silo", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=AGENT_SECONDS,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "connection.aggregator in silo.toml: expected host:port" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
