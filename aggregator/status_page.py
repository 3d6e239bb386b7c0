"""The aggregator's read-only status page: rounds, silos and their last contact, accuracy per round, and the
audit log with its hash chain verified — what an operator or an auditor checks in a browser.

`[server] status_page = "host:port"` turns it on. On a loopback address it is served over plain HTTP to this
machine only (reach it from elsewhere through an SSH tunnel); on any other address over HTTPS with the
aggregator's certificate, and only to clients presenting an unrevoked operator certificate of the consortium
CA — a silo's certificate is refused (403), a client without one fails the TLS handshake. The page changes
nothing: GET only, no forms, no scripts, and a Content-Security-Policy that loads nothing from anywhere.
`/status.json` gives the same facts to scripts.
"""

from __future__ import annotations

import html
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509

from aggregator.store import Store, StoreError
from privacy.pki.identity import PkiError, RevocationList, operator_name_of

log = logging.getLogger("aggregator.status_page")

AUDIT_SHOWN = 50  # the newest audit records on the page; the chain is verified over all of them
HANDSHAKE_SECONDS = 10.0  # a client that stalls its TLS handshake or request holds one thread this long
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def snapshot(status: dict, about: dict, store: Store) -> dict:
    """Everything the page shows, as JSON-ready values: the engine's `status()`, the run's facts (`about`:
    consortium, method, privacy, total rounds) and what the store keeps."""
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


# --- the page ---------------------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 70em; color: #1b1b1b; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: 0.25em 0.6em; }
th { border-bottom: 2px solid #888; } td { border-bottom: 1px solid #ddd; vertical-align: top; }
.ok { color: #176317; font-weight: 600; } .bad { color: #a31515; font-weight: 600; }
.muted { color: #666; } code { font-size: 0.92em; word-break: break-all; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""
SERIES = (("accuracy", "overall", "#1f5fa8"), ("few", "few-shot", "#c0392b"))


def render(snap: dict) -> str:
    e = html.escape
    done, total = snap["committed_rounds"], snap["total_rounds"]
    flight = (
        f"<p>In flight: <code>{e(snap['round_id'])}</code>, {len(snap['submitted'])} of "
        f"{len(snap['participants'])} contributions, stage {e(snap['stage'])}.</p>"
        if snap["round_id"]
        else f"<p>Stage: {e(snap['stage'])}.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="15">
<title>fedlt · {e(snap["consortium_id"])}</title><style>{STYLE}</style></head>
<body>
<h1>Consortium {e(snap["consortium_id"])}</h1>
<p class="muted">{e(snap["method"])} over {e(snap["privacy"])} · read-only · as of
{_when(snap["generated_unix_ms"])} UTC (refreshes every 15 s)</p>
<p id="rounds"><strong>{done} of {total}</strong> rounds committed · state
<code>{e(snap["state_digest"][:16])}</code></p>
{flight}
{_warnings(snap.get("certificate_warnings", []))}
<h2>Silos</h2>
{_silos(snap)}
<h2>Accuracy per round</h2>
{_chart(snap["metrics"], snap["total_rounds"])}
<h2>Audit log</h2>
{_audit(snap["audit"])}
</body></html>
"""


def _warnings(warnings: list[str]) -> str:
    """Certificates about to expire and roster problems, each with what resolves it."""
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f"<h2>Certificates</h2><ul id='certificates' class='bad'>{items}</ul>"


def _when(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix_ms / 1000))


def _silos(snap: dict) -> str:
    if not snap["silos"]:
        return "<p class='muted'>No silo has registered yet.</p>"
    now = snap["generated_unix_ms"]
    rows = []
    for s in snap["silos"]:
        seen = s["last_seen_unix_ms"]
        contact = f"{(now - seen) / 1000:.0f} s ago ({_when(seen)})" if seen else "never"
        left = s.get("privacy_remaining")
        rows.append(
            f"<tr><td>{html.escape(s['silo_id'])}</td>"
            f"<td class='{'ok' if s['connected'] else 'muted'}'>{'yes' if s['connected'] else 'no'}</td>"
            f"<td>{html.escape(s['activity'])}</td><td>{contact}</td>"
            f"<td>{s['last_contributed_round']}</td><td>{'-' if left is None else f'{left:.3g}'}</td></tr>"
        )
    head = "<tr><th>silo</th><th>connected</th><th>activity</th><th>last contact</th>"
    head += "<th>last round</th><th>ε left</th></tr>"
    return f"<table id='silos'>{head}{''.join(rows)}</table>"


def _chart(metrics: list[dict], total_rounds: int, width: int = 720, height: int = 260) -> str:
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
        f"<svg id='accuracy' role='img' width='{width}' height='{height}' "
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


def _audit(audit: dict) -> str:
    verdict = (
        f"<p id='chain' class='ok'>Hash chain verified over all {audit['records']} records.</p>"
        if audit["verified"]
        else f"<p id='chain' class='bad'>Hash chain broken: {html.escape(audit['problem'])}</p>"
    )
    rows = "".join(
        f"<tr><td>{r['seq']}</td><td>{_when(r['at_unix_ms'])}</td><td>{html.escape(r['event'])}</td>"
        f"<td><code>{html.escape(json.dumps(r['detail'], sort_keys=True)[:300])}</code></td></tr>"
        for r in audit["recent"]
    )
    shown = f"<p class='muted'>The newest {len(audit['recent'])}, newest first.</p>"
    head = "<tr><th>#</th><th>UTC</th><th>event</th><th>detail</th></tr>"
    return f"{verdict}{shown}<table id='audit'>{head}{rows}</table>"


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


class StatusPage:
    """The page's HTTP server (HTTPS with `tls`) on its own threads; `stop()` closes it."""

    def __init__(
        self,
        listen: str,
        facts: Callable[[], dict],
        revocations: RevocationList,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        host, port = split_listen(listen)
        if tls is None and not is_loopback(host):
            raise ValueError(f"{host} is not a loopback address: the page is served there over HTTPS only")
        self.tls = tls
        self.server = _Server((host, port), _handler(facts, revocations), tls)
        self._thread = threading.Thread(target=self.server.serve_forever, name="status-page", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{shown}:{port}/"

    def start(self) -> StatusPage:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {listen!r}")
    return host.strip("[]"), int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, tls: ssl.SSLContext | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        super().__init__(address, handler)

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:
        """The TLS handshake runs on the request's own thread, bounded, so a stalled client blocks no one."""
        request.settimeout(HANDSHAKE_SECONDS)
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.info("status page: TLS handshake with %s failed: %s", client_address[0], exc)
                return
        super().finish_request(request, client_address)


def _handler(facts: Callable[[], dict], revocations: RevocationList) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fedlt-status"
        sys_version = ""

        def do_GET(self) -> None:
            refusal = self._refusal()
            if refusal:
                self._send(HTTPStatus.FORBIDDEN, "text/plain; charset=utf-8", refusal.encode())
                return
            path = self.path.split("?", 1)[0]
            if path not in ("/", "/status.json"):
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")
                return
            snap = facts()
            if path == "/":
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", render(snap).encode())
            else:
                self._send(HTTPStatus.OK, "application/json", json.dumps(snap, indent=1).encode())

        def do_HEAD(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", b"")

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD  # noqa: N815 (read-only)

        def _refusal(self) -> str:
            """Why this client may not read the page ('' if it may): over HTTPS, only operators."""
            if not isinstance(self.connection, ssl.SSLSocket):
                return ""
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

        def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in HEADERS.items():
                self.send_header(name, value)
            if status == HTTPStatus.METHOD_NOT_ALLOWED:
                self.send_header("Allow", "GET")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("status page: %s %s", self.address_string(), format % args)

    return Handler
