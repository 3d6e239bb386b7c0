"""Prometheus metrics, in the text format `prometheus_client` writes (its registry and `generate_latest`).

Two endpoints. The aggregator's (`ConsortiumCollector`, served at `/metrics` by the status page, under the
page's credentials): its studies by state and, for each study that has run (`ConsortiumFacts`, under a
`study` label), rounds, round durations, test accuracy, silos and their contact, attempts, refusals and
dropouts from the study's audit log, and each silo's ε left as it chose to report it. A silo agent's own
(`SiloMetrics`, served by `MetricsServer`, off by default): only what the silo itself knows.

Metric names follow Prometheus's conventions: `_total` counters, `_seconds` and `_bytes` units, one
`_timestamp_seconds` gauge per clock reading, labels for what varies. A value that is not known (a shot
group without classes, a silo that reports no ε) has no sample: missing is not zero.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from fedlt.listen import LOOPBACK_NAMES, bracketed, is_loopback, split_listen
from fedlt.telemetry import GROUP_TAGS

log = logging.getLogger("fedlt.telemetry")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus server reads
PATH = "/metrics"
# round durations: a round of a few silos on CPUs takes seconds, one of large models or slow silos an hour
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
READ_SECONDS = 10.0  # a client that stalls its request holds one thread this long


def exposition(collector: Collector) -> bytes:
    """The metrics of one collector, in a registry of their own (never the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


# --- the aggregator -----------------------------------------------------------------------------------

STUDY = ("study",)  # the label of every series that is one study's


@dataclass(frozen=True)
class ConsortiumFacts:
    """What the aggregator knows of one study at a scrape. `silos`: the study's round table's view of each
    silo (`silo_id`, `connected`, `last_seen_unix_ms`, `last_contributed_round`, and `privacy_remaining`
    where the silo reports it); `history`: the recorded metrics entries, in order; `attempts` by outcome and
    `refusals` by code, from the study's audit log, as are `dropouts` (silos a committed round invited and
    its sum did not count) and `contributions` (accepted); `state_bytes`: the global state each invited silo
    downloads."""

    consortium: str
    study: str
    method: str
    privacy: str
    planned_rounds: int
    committed_rounds: int
    dp_enabled: bool
    classes: Sequence[str]
    silos: Sequence[Mapping] = ()
    history: Sequence[Mapping] = ()
    attempts: Mapping[str, int] = field(default_factory=dict)
    refusals: Mapping[str, int] = field(default_factory=dict)
    dropouts: int = 0
    contributions: int = 0
    state_bytes: int | None = None
    audit_verified: bool = True
    audit_records: int = 0


class ConsortiumCollector:
    """The aggregator's metric families, made afresh at each scrape: each study's `ConsortiumFacts` under a
    `study` label (a queued study that never ran has none), the studies counted by state (`states`: every
    state the catalog knows, none left out, so a state without studies reads 0), and the certificate
    warnings, which are the aggregator's, once."""

    def __init__(
        self, studies: Sequence[ConsortiumFacts], *, states: Mapping[str, int], certificate_warnings: int
    ) -> None:
        self.studies = studies
        self.states = states
        self.certificate_warnings = certificate_warnings

    def collect(self) -> Iterator[Metric]:
        studies = self.studies
        by_state = GaugeMetricFamily(
            "fedlt_studies", "Studies on this aggregator, by state", labels=["state"]
        )
        for state, count in self.states.items():
            by_state.add_metric([state], count)
        yield by_state
        info = InfoMetricFamily(
            "fedlt_consortium", "The consortium and each study's method and layer", labels=STUDY
        )
        for f in studies:
            info.add_metric([f.study], {"consortium": f.consortium, "method": f.method, "privacy": f.privacy})
        yield info
        yield _each(
            CounterMetricFamily("fedlt_rounds_committed", "Rounds committed", labels=STUDY),
            studies,
            lambda f: f.committed_rounds,
        )
        yield _each(
            GaugeMetricFamily("fedlt_rounds_planned", "Training rounds the study asks for", labels=STUDY),
            studies,
            lambda f: f.planned_rounds,
        )
        yield _durations(studies)
        yield from _accuracy(studies)
        yield from _silos(studies)
        yield from _audit(studies)
        yield _each(
            GaugeMetricFamily(
                "fedlt_state_bytes", "Bytes of the global state each invited silo downloads", labels=STUDY
            ),
            studies,
            lambda f: f.state_bytes,
        )
        yield GaugeMetricFamily(
            "fedlt_certificate_warnings",
            "Certificates about to expire and roster problems (the status page lists them)",
            value=self.certificate_warnings,
        )


def _each(
    family: GaugeMetricFamily | CounterMetricFamily,
    studies: Sequence[ConsortiumFacts],
    value: Callable[[ConsortiumFacts], float | None],
) -> Metric:
    """`family` with one sample per study, labelled by it; a study whose value is not known has none."""
    for f in studies:
        found = value(f)
        if found is not None:
            family.add_metric([f.study], found)
    return family


def _silos(studies: Sequence[ConsortiumFacts]) -> Iterator[Metric]:
    """Each study's silos as its round table sees them: a silo in two studies has a series in each."""
    yield _each(
        GaugeMetricFamily("fedlt_silos_registered", "Silos that have registered", labels=STUDY),
        studies,
        lambda f: len(f.silos),
    )
    yield _each(
        GaugeMetricFamily("fedlt_silos_connected", "Silos connected now", labels=STUDY),
        studies,
        lambda f: sum(bool(s["connected"]) for s in f.silos),
    )
    labels = [*STUDY, "silo"]
    each = GaugeMetricFamily("fedlt_silo_connected", "Whether the silo is connected now", labels=labels)
    seen = GaugeMetricFamily(
        "fedlt_silo_last_seen_timestamp_seconds", "When the silo was last heard from", labels=labels
    )
    last = GaugeMetricFamily(
        "fedlt_silo_last_contributed_round", "The last round the silo contributed to", labels=labels
    )
    left = GaugeMetricFamily(
        "fedlt_epsilon_remaining",
        "ε left in the silo's privacy budget, as the silo reported it (only silos whose policy reports)",
        labels=labels,
    )
    for f in studies:
        for s in f.silos:
            silo = [f.study, s["silo_id"]]
            each.add_metric(silo, float(bool(s["connected"])))
            if s.get("last_seen_unix_ms"):
                seen.add_metric(silo, s["last_seen_unix_ms"] / 1000)
            last.add_metric(silo, s.get("last_contributed_round", 0))
            if f.dp_enabled and s.get("privacy_remaining") is not None:  # without [dp]: a lifetime budget
                left.add_metric(silo, s["privacy_remaining"])
    yield from (each, seen, last, left)


def _audit(studies: Sequence[ConsortiumFacts]) -> Iterator[Metric]:
    """What each study's audit log says: attempts by outcome, refusals by code, dropouts, contributions."""
    attempts = CounterMetricFamily(
        "fedlt_attempts", "Round attempts ended, by outcome", labels=[*STUDY, "outcome"]
    )
    refusals = CounterMetricFamily(
        "fedlt_refusals", "Attempts silos refused, by code", labels=[*STUDY, "code"]
    )
    for f in studies:
        for outcome in ("committed", "aborted", "abandoned"):
            attempts.add_metric([f.study, outcome], f.attempts.get(outcome, 0))
        for code, count in sorted(f.refusals.items()):
            refusals.add_metric([f.study, code], count)
    yield from (attempts, refusals)
    yield _each(
        CounterMetricFamily(
            "fedlt_dropouts", "Silos a committed round invited and its sum did not count", labels=STUDY
        ),
        studies,
        lambda f: f.dropouts,
    )
    yield _each(
        CounterMetricFamily("fedlt_contributions", "Contributions accepted", labels=STUDY),
        studies,
        lambda f: f.contributions,
    )
    yield _each(
        GaugeMetricFamily(
            "fedlt_audit_chain_verified", "1 if the audit log's hash chain verifies", labels=STUDY
        ),
        studies,
        lambda f: int(f.audit_verified),
    )
    yield _each(
        GaugeMetricFamily("fedlt_audit_records", "Records in the audit log", labels=STUDY),
        studies,
        lambda f: f.audit_records,
    )


def _durations(studies: Sequence[ConsortiumFacts]) -> HistogramMetricFamily:
    """Each study's recorded rounds' durations (a round re-evaluated after a restart has none)."""
    family = HistogramMetricFamily(
        "fedlt_round_duration_seconds", "Seconds from a round's RoundSpec to its commit", labels=STUDY
    )
    for f in studies:
        seconds = [e["seconds"] for e in f.history if isinstance(e.get("seconds"), int | float)]
        buckets = [(str(b), sum(s <= b for s in seconds)) for b in DURATION_BUCKETS]
        family.add_metric([f.study], [*buckets, ("+Inf", len(seconds))], sum_value=float(sum(seconds)))
    return family


def _accuracy(studies: Sequence[ConsortiumFacts]) -> Iterator[Metric]:
    """Accuracy of each study's last evaluated round, overall, by shot group and by class (a study not yet
    evaluated has no sample)."""
    rounds = GaugeMetricFamily("fedlt_test_accuracy_round", "The round the accuracy is of", labels=STUDY)
    groups = GaugeMetricFamily(
        "fedlt_test_accuracy", "Test accuracy, overall and by shot group", labels=[*STUDY, "group"]
    )
    per_class = GaugeMetricFamily(
        "fedlt_test_class_accuracy", "Test accuracy of each class", labels=[*STUDY, "class"]
    )
    for f in studies:
        evaluated = [e for e in f.history if e.get("accuracy") is not None]
        if not evaluated:
            continue
        entry = evaluated[-1]
        rounds.add_metric([f.study], entry["round"])
        for key, group in GROUP_TAGS.items():
            if entry.get(key) is not None:
                groups.add_metric([f.study, group], entry[key])
        for name, value in zip(f.classes, entry.get("per_class") or [], strict=False):
            if value is not None:
                per_class.add_metric([f.study, name], value)
    yield from (rounds, groups, per_class)


# --- a silo agent -------------------------------------------------------------------------------------


class SiloMetrics:
    """A silo agent's own counts, in a registry of its own: the rounds it took part in, its refusals by
    code, the ε its ledger has spent, and its contact with the aggregator. `epsilon_spent` is read at each
    scrape; counters start at zero with the agent (Prometheus reads a restart from the drop)."""

    def __init__(
        self, *, refusal_codes: Sequence[str], epsilon_spent: Callable[[], float], epsilon_budget: float
    ) -> None:
        self.registry = CollectorRegistry()
        self.rounds = Counter(
            "fedlt_silo_rounds_taken_part",
            "Round attempts this silo contributed to (a round tried again counts once per attempt)",
            registry=self.registry,
        )
        self.refusals = Counter(
            "fedlt_silo_refusals", "Attempts this silo refused, by code", ["code"], registry=self.registry
        )
        for code in refusal_codes:
            self.refusals.labels(code)
        self.last_contact = Gauge(
            "fedlt_silo_last_contact_timestamp_seconds",
            "When the aggregator last sent this silo anything (a session opened, a directive)",
            registry=self.registry,
        )
        self.connected = Gauge("fedlt_silo_connected", "1 while a session is up", registry=self.registry)
        spent = Gauge("fedlt_silo_epsilon_spent", "ε this silo's ledger has spent", registry=self.registry)
        spent.set_function(epsilon_spent)
        budget = Gauge("fedlt_silo_epsilon_budget", "This silo's lifetime ε budget", registry=self.registry)
        budget.set(epsilon_budget)

    def contact(self) -> None:
        self.last_contact.set(time.time())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """`/metrics` over plain HTTP for a silo's Prometheus, on its own threads; GET only. On a loopback
    address it answers only requests whose `Host` names it, so a web page that an attacker's DNS points at
    127.0.0.1 (DNS rebinding) reads nothing through a browser of this machine. There is no authentication:
    any other address is the silo administrator's explicit choice (`silo.config.MonitoringSection`)."""

    def __init__(self, listen: str, exposition: Callable[[], bytes]) -> None:
        host, port = split_listen(listen)
        self.server = _Server((host, port))
        bound = self.server.server_address[1]
        hosts = _hosts(host, bound) if is_loopback(host) else None
        self.server.RequestHandlerClass = _handler(exposition, hosts)
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{bracketed(host)}:{port}{PATH}"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _hosts(host: str, port: int) -> frozenset[str]:
    return frozenset(f"{bracketed(name)}:{port}" for name in {host, *LOOPBACK_NAMES})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, BaseHTTPRequestHandler)

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:
        request.settimeout(READ_SECONDS)
        super().finish_request(request, client_address)


def _handler(exposition: Callable[[], bytes], hosts: frozenset[str] | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fedlt-metrics"
        sys_version = ""

        def do_GET(self) -> None:
            named = self.headers.get_all("Host") or []
            if hosts is not None and (len(named) != 1 or named[0].strip().lower() not in hosts):
                self._send(HTTPStatus.MISDIRECTED_REQUEST, b"this endpoint answers only to its own address\n")
            elif self.command != "GET":
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"")
            elif self.path.split("?", 1)[0] != PATH:
                self._send(HTTPStatus.NOT_FOUND, b"not found; metrics are at /metrics\n")
            else:
                self._send(HTTPStatus.OK, exposition(), CONTENT_TYPE)

        do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET  # noqa: N815 (405 but GET)

        def _send(self, status: HTTPStatus, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if status == HTTPStatus.METHOD_NOT_ALLOWED:
                self.send_header("Allow", "GET")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: %s %s", self.address_string(), format % args)

    return Handler
