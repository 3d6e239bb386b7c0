"""The aggregator's read-only status page: its studies, where each stands, and for each that has run its
rounds, silos and their last contact, accuracy per round, and the audit log with its hash chain verified —
what an operator or an auditor checks in a browser.

`[server] status_page = "host:port"` turns it on. On a loopback address it is served over plain HTTP to this
machine only (reach it from elsewhere through an SSH tunnel), and only to requests holding the access token
the aggregator writes at each start to a file only its user can read (`Authorization: Bearer`, or `?token=`
once, which a cookie then replaces). On any other address it is served over HTTPS with the aggregator's
certificate, and only to clients presenting an unrevoked operator certificate of the consortium CA — a
silo's certificate is refused (403), a client without one fails the TLS handshake. Either way a request whose
`Host` header names anything but the page is refused (421) before anything is read: that is what stops a
DNS-rebinding page in the operator's browser. The page changes nothing: GET only, no forms, no scripts, and a
Content-Security-Policy that loads nothing from anywhere. `/status.json` gives the same facts to scripts, and
`/metrics` to Prometheus (`fedlt.telemetry.prometheus`), under the same credentials: Prometheus sends the
token as a bearer token read from the token file at each scrape, or presents an operator certificate.
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import re
import secrets
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from cryptography import x509

from aggregator.catalog import STATES, StudyInfo
from aggregator.store import AuditRecord, Store, StoreError
from fedlt.atomic import atomic_write_text
from fedlt.listen import LOOPBACK_NAMES, bracketed, is_loopback, split_listen
from fedlt.telemetry.prometheus import CONTENT_TYPE as METRICS_TYPE
from privacy.pki.identity import PkiError, RevocationList, operator_name_of

log = logging.getLogger("aggregator.status_page")

AUDIT_SHOWN = 50  # the newest audit records on the page; the chain is verified over all of them
HANDSHAKE_SECONDS = 10.0  # a client that stalls its TLS handshake or request holds one connection this long
# Connections served at once: a browser opens up to six per host, scripts one; a flood above this costs
# one accept() and one close() each, never a thread or a handshake.
CONNECTIONS = 16
PATHS = ("/", "/status.json", "/metrics")
COOKIE = "fedlt_status"  # the port is appended: cookies are per host, not per port
TOKEN_FILE = "status-page.token"  # in the aggregator's data_dir unless [server] status_page_token names one
QUERY_TOKEN = re.compile(r"([?&]token=)[^&\s]*")
TEXT = "text/plain; charset=utf-8"
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def snapshot(status: dict, about: dict, store: Store) -> dict:
    """Everything the page shows, as JSON-ready values: the inbox's `status()`, the run's facts (`about`:
    consortium, method, privacy, total rounds, `dp_enabled`: whether the plan enables [dp], without which a
    silo's `privacy_remaining` is its lifetime budget, not this study's) and what the store keeps."""
    try:
        store.verify_audit()
        chain = {"verified": True, "problem": ""}
    except StoreError as exc:
        chain = {"verified": False, "problem": str(exc)}
    records = store.audit_log()
    return {
        **about,
        "generated_unix_ms": int(time.time() * 1000),
        **status,
        "metrics": [
            {k: m.get(k) for k in ("round", "accuracy", "many", "medium", "few", "seconds")}
            for m in store.metrics_history()
        ],
        "audit": {
            **chain,
            "records": len(records),
            "recent": [
                {"seq": r.seq, "at_unix_ms": r.at_ms, "event": r.event, "detail": r.detail}
                for r in records[-AUDIT_SHOWN:][::-1]
            ],
        },
    }


def aggregator_snapshot(
    default: dict | None, studies: list[dict], *, consortium_id: str, warnings: list[str]
) -> dict:
    """What the page and `status.json` show of the whole aggregator: its studies (`study_entry` each) and,
    at the top level as before studies existed, the default study's `snapshot` (`default`; None when the
    aggregator has none), so that scripts reading `status.json` keep working. The certificate warnings are
    the aggregator's, not a study's."""
    return {
        **(default or {}),
        "consortium_id": consortium_id,
        "generated_unix_ms": int(time.time() * 1000),
        "certificate_warnings": warnings,
        "studies": studies,
    }


def study_entry(info: StudyInfo, detail: dict | None) -> dict:
    """One study's row of `aggregator_snapshot`: where it stands, and its `snapshot` as `detail` (None for a
    study with no store yet: queued, never run)."""
    return {
        "id": info.id,
        "state": info.state,
        "reason": info.reason,
        "is_default": info.is_default,
        "queue_position": info.queue_position,
        "method": info.method,
        "privacy": info.privacy,
        "committed_rounds": info.committed_rounds,
        "total_rounds": info.total_rounds,
        "detail": detail,
    }


def study_states(studies: Iterable[StudyInfo]) -> dict[str, int]:
    """The studies counted by state, every state named: `/metrics` then reads 0 for a state without studies
    rather than nothing."""
    counts = Counter(info.state for info in studies)
    return {state: counts[state] for state in STATES}


def standing(state: str, reason: str, queue_position: int) -> str:
    """Where a study stands, in words, the same on the page, in the operator's commands and to silos: a
    queued study's place in line, any other state with why it is there."""
    if state == "queued" and queue_position:
        return f"queued ({ordinal(queue_position)} in line)"
    return f"{state}: {reason}" if reason else state


def ordinal(n: int) -> str:
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass
class AuditTally:
    """What the audit log says of rounds, for `/metrics` and each round's metrics: attempts ended by outcome,
    refusals by code, contributions accepted, and each committed round's invited silos and those its sum
    counted (round -> (invited, counted))."""

    attempts: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    contributions: int = 0
    rounds: dict[int, tuple[list[str], list[str]]] = field(default_factory=dict)

    @property
    def dropouts(self) -> int:
        """Silos a committed round invited and its sum did not count (dropped, refused or too late)."""
        return sum(len(set(invited) - set(counted)) for invited, counted in self.rounds.values())


def audit_tally(records: Iterable[AuditRecord]) -> AuditTally:
    tally, invited = AuditTally(), {}
    for record in records:
        event, detail = record.event, record.detail
        if event == "attempt_started":
            invited[detail["round_id"]] = detail["participants"]
        elif event == "round_committed":
            tally.attempts["committed"] += 1
            counted = detail["contributors"]
            tally.rounds[detail["round"]] = (invited.get(detail["round_id"], counted), counted)
        elif event in ("attempt_aborted", "attempt_abandoned"):
            tally.attempts[event.removeprefix("attempt_")] += 1
        elif event == "round_refused":
            tally.refusals[detail["code"]] += 1
        elif event == "contribution_accepted":
            tally.contributions += 1
    return tally


# --- the page ---------------------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 70em; color: #1b1b1b; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: 0.25em 0.6em; }
th { border-bottom: 2px solid #888; } td { border-bottom: 1px solid #ddd; vertical-align: top; }
.ok { color: #176317; font-weight: 600; } .bad { color: #a31515; font-weight: 600; }
.muted { color: #666; } code { font-size: 0.92em; word-break: break-all; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""
SERIES = (("accuracy", "overall", "#1f5fa8"), ("few", "few-shot", "#c0392b"))
STATE_CLASS = {"running": "ok", "failed": "bad"}  # how the studies table colours a state


def render(snap: dict) -> str:
    """The page of `aggregator_snapshot`: the studies in a table, then each study that has run in a section
    of its own, `#study-<id>`."""
    e = html.escape
    sections = "".join(_study(row) for row in snap["studies"] if row["detail"] is not None)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="15">
<title>fedlt · {e(snap["consortium_id"])}</title><style>{STYLE}</style></head>
<body>
<h1>Consortium {e(snap["consortium_id"])}</h1>
<p class="muted">read-only · as of {_when(snap["generated_unix_ms"])} UTC (refreshes every 15 s)</p>
{_warnings(snap["certificate_warnings"])}
<h2>Studies</h2>
{_studies(snap["studies"])}
{sections}</body></html>
"""


def _studies(rows: list[dict]) -> str:
    """One line per study: a link to its section where it has one, where it stands, what it runs."""
    e = html.escape
    if not rows:
        return (
            "<p class='muted'>No study yet (the operator creates one: python -m aggregator study create).</p>"
        )
    lines = []
    for row in rows:
        key = e(row["id"])
        name = f"<a href='#study-{key}'>{key}</a>" if row["detail"] is not None else key
        if row["is_default"]:
            name += " <span class='muted'>(default)</span>"
        runs = f"{e(row['method'])} over {e(row['privacy'])}" if row["method"] else "-"
        state = standing(row["state"], row["reason"], row["queue_position"])
        lines.append(
            f"<tr><td>{name}</td><td class='{STATE_CLASS.get(row['state'], 'muted')}'>{e(state)}</td>"
            f"<td>{runs}</td><td>{row['committed_rounds']} of {row['total_rounds']}</td></tr>"
        )
    head = "<tr><th>study</th><th>state</th><th>method over layer</th><th>rounds committed</th></tr>"
    return f"<table id='studies'>{head}{''.join(lines)}</table>"


def _study(row: dict) -> str:
    """A study's section: its rounds, the round in flight, its silos, accuracy and audit log."""
    e, snap = html.escape, row["detail"]
    key = f"study-{e(row['id'])}"
    flight = (
        f"<p>In flight: <code>{e(snap['round_id'])}</code>, {len(snap['submitted'])} of "
        f"{len(snap['participants'])} contributions, stage {e(snap['stage'])}.</p>"
        if snap["round_id"]
        else f"<p>Stage: {e(snap['stage'])}.</p>"
    )
    state = standing(row["state"], row["reason"], row["queue_position"])
    return f"""<h2 id="{key}">Study {e(row["id"])}</h2>
<p class="muted">{e(snap["method"])} over {e(snap["privacy"])} · {e(state)}</p>
<p id="{key}-rounds"><strong>{snap["committed_rounds"]} of {snap["total_rounds"]}</strong> rounds committed
· state <code>{e(snap["state_digest"][:16])}</code></p>
{flight}
<h3>Silos</h3>
{_silos(snap, key)}
<h3>Accuracy per round</h3>
{_chart(snap["metrics"], snap["total_rounds"], key)}
<h3>Audit log</h3>
{_audit(snap["audit"], key)}
"""


def _warnings(warnings: list[str]) -> str:
    """Certificates about to expire and roster problems, each with what resolves it."""
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f"<h2>Certificates</h2><ul id='certificates' class='bad'>{items}</ul>"


def _when(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_ms / 1000))


def _silos(snap: dict, key: str) -> str:
    if not snap["silos"]:
        return "<p class='muted'>No silo has registered yet.</p>"
    now = snap["generated_unix_ms"]
    rows = []
    for s in snap["silos"]:
        seen = s["last_seen_unix_ms"]
        contact = f"{(now - seen) / 1000:.0f} s ago ({_when(seen)})" if seen else "never"
        rows.append(
            f"<tr><td>{html.escape(s['silo_id'])}</td>"
            f"<td class='{'ok' if s['connected'] else 'muted'}'>{'yes' if s['connected'] else 'no'}</td>"
            f"{_activity(s)}<td>{contact}</td>"
            f"<td>{s['last_contributed_round']}</td>{_epsilon_left(s, snap['dp_enabled'])}</tr>"
        )
    head = "<tr><th>silo</th><th>connected</th><th>activity</th><th>last contact</th>"
    head += "<th>last round</th><th>ε left</th></tr>"
    return f"<table id='{key}-silos'>{head}{''.join(rows)}</table>"


def _epsilon_left(silo: dict, dp: bool) -> str:
    """Without [dp] in the plan a silo's reported ε left is its lifetime budget, which this study does not
    spend: "no DP" then, so it does not read as this study's (status.json keeps the raw value, and
    `dp_enabled`)."""
    if not dp:
        return "<td class='muted'>no DP</td>"
    left = silo.get("privacy_remaining")
    return f"<td>{'-' if left is None else f'{left:.3g}'}</td>"


def _activity(silo: dict) -> str:
    """The silo's activity cell; while its refusal of the round stands, `refused: <code>` and its words."""
    refusal = silo.get("refusal")
    if refusal is None:
        return f"<td>{html.escape(silo['activity'])}</td>"
    return (
        f"<td class='bad'>refused: {html.escape(refusal['code'])}<br><span class='muted'>"
        f"{html.escape(refusal['round_id'])}: {html.escape(refusal['text'])}</span></td>"
    )


def _chart(metrics: list[dict], total_rounds: int, key: str, width: int = 720, height: int = 260) -> str:
    """An inline SVG line chart (no scripts, nothing fetched): accuracy and few-shot accuracy in % over the
    run's rounds, so the chart also shows how far the run is."""
    points = [m for m in metrics if m.get("accuracy") is not None]
    if not points:
        return (
            "<p class='muted'>No evaluated round yet (the aggregator evaluates when [evaluation] is set).</p>"
        )
    left, right, top, bottom = 44, 12, 10, 30
    last = max(max(m["round"] for m in points), total_rounds, 1)

    def x(round_number: int) -> float:
        return left + (width - left - right) * round_number / last

    def y(value: float) -> float:
        return top + (height - top - bottom) * (1 - value)

    parts = [
        f"<svg id='{key}-accuracy' role='img' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' aria-label='accuracy per round'>"
    ]
    for tick in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(
            f"<line x1='{left}' x2='{width - right}' y1='{y(tick):.1f}' y2='{y(tick):.1f}' stroke='#ddd'/>"
            f"<text x='{left - 6}' y='{y(tick) + 4:.1f}' text-anchor='end'>{tick:.0%}</text>"
        )
    parts.append(f"<text x='{(width + left) / 2:.0f}' y='{height - 6}' text-anchor='middle'>round</text>")
    for r in sorted({0, last // 2, last}):
        parts.append(f"<text x='{x(r):.1f}' y='{height - 16}' text-anchor='middle'>{r}</text>")
    legend = []
    for key, label, colour in SERIES:
        series = [(m["round"], m[key]) for m in points if m.get(key) is not None]
        if not series:
            continue
        path = " ".join(f"{x(r):.1f},{y(v):.1f}" for r, v in series)
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='{path}'/>")
        legend.append(f"<span style='color:{colour}'>■</span> {label} {series[-1][1]:.1%}")
    parts.append("</svg>")
    return "".join(parts) + f"<p>Last evaluated round {points[-1]['round']}: {' · '.join(legend)}</p>"


def _audit(audit: dict, key: str) -> str:
    verdict = (
        f"<p id='{key}-chain' class='ok'>Hash chain verified over all {audit['records']} records.</p>"
        if audit["verified"]
        else f"<p id='{key}-chain' class='bad'>Hash chain broken: {html.escape(audit['problem'])}</p>"
    )
    rows = "".join(
        f"<tr><td>{r['seq']}</td><td>{_when(r['at_unix_ms'])}</td><td>{html.escape(r['event'])}</td>"
        f"<td><code>{html.escape(json.dumps(r['detail'], sort_keys=True)[:300])}</code></td></tr>"
        for r in audit["recent"]
    )
    shown = f"<p class='muted'>The newest {len(audit['recent'])}, newest first.</p>"
    head = "<tr><th>#</th><th>UTC</th><th>event</th><th>detail</th></tr>"
    return f"{verdict}{shown}<table id='{key}-audit'>{head}{rows}</table>"


# --- serving ----------------------------------------------------------------------------------------------


def operator_tls(certificate: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """HTTPS with the aggregator's certificate, to clients with a certificate of the consortium CA (whose
    role and revocation each request then checks)."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.minimum_version = ssl.TLSVersion.TLSv1_2
    tls.load_cert_chain(certificate, key)
    tls.load_verify_locations(ca)
    tls.verify_mode = ssl.CERT_REQUIRED
    return tls


def certificate_names(certificate: Path) -> list[str]:
    """The host names and addresses a certificate is valid for: the only names a browser reaches the HTTPS
    page by without a warning, so the only `Host` values that page answers."""
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))]


def write_token(path: Path) -> str:
    """A fresh access token, written where only this user can read it (mode 0600, replaced in one step)."""
    token = secrets.token_urlsafe(32)
    atomic_write_text(path, token + "\n")
    path.chmod(0o600)
    return token


class StatusPage:
    """The page's HTTP server (HTTPS with `tls`) on its own threads; `stop()` closes it.

    Over HTTPS the client's operator certificate is the credential. Over loopback HTTP it is a token made at
    each start and written to `token_file` (readable only by the aggregator's user), since any process of
    the machine, and any web page in its browsers, can reach a loopback port. Either way the `Host` header
    must name the page (`hosts`): a DNS-rebinding page in the operator's browser reaches the port under its
    own name and is refused before anything is read. At most `connections` are served at once; more are
    closed as soon as they are accepted, before any TLS work, and each waits at most `timeout` seconds for
    a handshake or a request. `metrics`: the Prometheus text `/metrics` serves (None: no such path).
    """

    def __init__(
        self,
        listen: str,
        facts: Callable[[], dict],
        revocations: RevocationList,
        tls: ssl.SSLContext | None = None,
        *,
        token_file: Path | None = None,
        names: Iterable[str] = (),
        connections: int = CONNECTIONS,
        timeout: float = HANDSHAKE_SECONDS,
        metrics: Callable[[], bytes] | None = None,
    ) -> None:
        host, port = split_listen(listen)
        if tls is None and not is_loopback(host):
            raise ValueError(f"{host} is not a loopback address: the page is served there over HTTPS only")
        if tls is None and token_file is None:
            raise ValueError("a page served over plain HTTP needs a file to write its access token to")
        if connections < 1 or timeout <= 0:
            raise ValueError(f"connections ({connections}) and timeout ({timeout}) must be positive")
        served = served_names(host, names)
        if not served:
            raise ValueError(f"{listen} names no host a browser could ask for: give the host names it serves")
        self.tls = tls
        self.token_file = None if tls else token_file
        token = None if self.token_file is None else write_token(self.token_file)
        self.server = _Server((host, port), tls, connections=connections, timeout=timeout)
        bound = self.server.server_address[1]
        hosts = host_headers(served, bound, default_port=443 if tls else 80)
        gate = _Gate(hosts=hosts, token=token, token_file=self.token_file, cookie=f"{COOKIE}_{bound}")
        # made here: it needs the bound port
        self.server.RequestHandlerClass = _handler(facts, revocations, gate, metrics)
        self._thread = threading.Thread(target=self.server.serve_forever, name="status-page", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{bracketed(host)}:{port}/"

    def start(self) -> StatusPage:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def served_names(host: str, names: Iterable[str]) -> set[str]:
    """The names the page answers to: the listen host unless it is a wildcard, every loopback name when it
    is loopback, and `names` (for HTTPS, those of the aggregator's certificate)."""
    served = {host.lower(), *(n.lower() for n in names)} - {"0.0.0.0", "::", ""}
    return served | set(LOOPBACK_NAMES) if is_loopback(host) else served


def host_headers(names: set[str], port: int, *, default_port: int) -> frozenset[str]:
    """Every `Host` value the page answers: each name with the port, and bare on the scheme's default."""
    with_port = {f"{bracketed(name)}:{port}" for name in names}
    return frozenset(with_port | ({bracketed(name) for name in names} if port == default_port else set()))


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most `connections` of them; the rest are closed when accepted."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], tls: ssl.SSLContext | None, *, connections: int, timeout: float
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.read_seconds = timeout
        self._slots = threading.BoundedSemaphore(connections)
        super().__init__(address, BaseHTTPRequestHandler)

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """Runs on the accepting thread: a connection over the cap costs no thread and no handshake."""
        if not self._slots.acquire(blocking=False):
            log.info("status page: %s refused, already serving the most connections", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:
        """The TLS handshake runs on the request's own thread, bounded, so a stalled client blocks no one."""
        request.settimeout(self.read_seconds)
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.info("status page: TLS handshake with %s failed: %s", client_address[0], exc)
                return
        super().finish_request(request, client_address)


@dataclass(frozen=True)
class _Gate:
    """Who may read: a request naming one of `hosts`, and over HTTP holding `token` (None over HTTPS)."""

    hosts: frozenset[str]
    token: str | None
    token_file: Path | None
    cookie: str

    def host_refusal(self, values: list[str]) -> str:
        """Why the `Host` header does not name this page ('' if it does)."""
        if len(values) != 1:
            return "a request needs exactly one Host header\n"
        if values[0].strip().lower() in self.hosts:
            return ""
        shown = ", ".join(sorted(self.hosts))
        return f"this page answers only to Host {shown}, not {values[0][:100]!r}\n"

    def holds_token(self, candidates: list[str]) -> bool:
        """Whether any credential presented is the token, each compared in constant time."""
        if self.token is None:
            return False
        expected = self.token.encode()
        return any(hmac.compare_digest(c.encode(errors="replace"), expected) for c in candidates)

    def token_missing(self) -> str:
        return (
            f"this page needs the access token the aggregator wrote to {self.token_file} when it started: "
            "open /?token=<that token> once (a cookie then keeps this browser in), or send the header "
            "'Authorization: Bearer <that token>'\n"
        )


def _handler(
    facts: Callable[[], dict], revocations: RevocationList, gate: _Gate, metrics: Callable[[], bytes] | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fedlt-status"
        sys_version = ""

        def do_GET(self) -> None:
            if self._refused():
                return
            path = urlsplit(self.path).path
            if self.command != "GET":
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, TEXT, b"", {"Allow": "GET"})
            elif path not in PATHS or (path == "/metrics" and metrics is None):
                self._send(HTTPStatus.NOT_FOUND, TEXT, b"not found\n")
            elif gate.token is not None and self._query_token():
                cookie = f"{gate.cookie}={gate.token}; Path=/; HttpOnly; SameSite=Strict"
                self._send(HTTPStatus.SEE_OTHER, TEXT, b"", {"Location": path, "Set-Cookie": cookie})
            elif path == "/":
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", render(facts()).encode())
            elif path == "/metrics":
                self._send(HTTPStatus.OK, METRICS_TYPE, metrics())
            else:
                self._send(HTTPStatus.OK, "application/json", json.dumps(facts(), indent=1).encode())

        do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET  # noqa: N815 (405 but GET)

        def _refused(self) -> bool:
            """Answer a request that may not read the page, first one naming another host; True if so."""
            refusal = gate.host_refusal(self.headers.get_all("Host") or [])
            if refusal:
                self._send(HTTPStatus.MISDIRECTED_REQUEST, TEXT, refusal.encode())
                return True
            if gate.token is None:
                refusal = self._operator_refusal()
                if refusal:
                    self._send(HTTPStatus.FORBIDDEN, TEXT, refusal.encode())
                return bool(refusal)
            if not gate.holds_token(self._presented()):
                challenge = {"WWW-Authenticate": 'Bearer realm="fedlt status page"'}
                self._send(HTTPStatus.UNAUTHORIZED, TEXT, gate.token_missing().encode(), challenge)
                return True
            return False

        def _presented(self) -> list[str]:
            """The credentials this request carries: a bearer header, the page's cookie, a `token` query."""
            found = []
            scheme, _, value = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() == "bearer":
                found.append(value.strip())
            # parsed by hand: SimpleCookie drops every cookie when one is malformed, and a loopback host's
            # cookies come from every local service, whatever its port
            cookies = "; ".join(self.headers.get_all("Cookie") or []).split(";")
            pairs = (part.strip().partition("=") for part in cookies)
            found += [value.strip() for name, _, value in pairs if name.strip() == gate.cookie]
            return found + self._query_tokens()

        def _query_tokens(self) -> list[str]:
            return parse_qs(urlsplit(self.path).query).get("token", [])

        def _query_token(self) -> bool:
            """Whether the token came in the query: it is then moved into a cookie and out of the URL."""
            return gate.holds_token(self._query_tokens())

        def _operator_refusal(self) -> str:
            """Why this client may not read the page over HTTPS ('' if it may): only operators."""
            der = self.connection.getpeercert(binary_form=True)
            if der is None:
                return "an operator certificate is required\n"
            cert = x509.load_der_x509_certificate(der)
            try:
                revocations.reload()
                if revocations.is_revoked(cert):
                    return "this certificate has been revoked by the consortium operator\n"
                operator_name_of(cert)
            except PkiError as exc:
                return f"only operators may read the status page: {exc}\n"
            return ""

        def _send(
            self, status: HTTPStatus, kind: str, body: bytes, extra: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in {**HEADERS, **(extra or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """At debug level, with any token in a request line left out of the log."""
            line = QUERY_TOKEN.sub(r"\1<token>", format % args)
            log.debug("status page: %s %s", self.address_string(), line)

    return Handler
