"""`python -m aggregator ca ...`: the operator's consortium CA commands (create, issue, renew, revoke, list).

Kept apart from `__main__` so the commands can be mounted on any argparse parser (the tests build their own).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from fedlt.errors import FedltError
from privacy.pki.ca import (
    CaPaths,
    IssuedPaths,
    init_ca,
    issue_operator,
    issue_server,
    issue_silo,
    list_issued,
    renew_ca,
    renew_server,
    renew_silo,
    revoke,
)
from privacy.pki.errors import PkiError
from privacy.pki.identity import ID_RULE, format_utc, read_certificate
from privacy.pki.roster import Roster


def add_ca_parser(subparsers: argparse._SubParsersAction) -> None:
    what = "the consortium CA: create it, issue and revoke certificates"
    ca = subparsers.add_parser("ca", help=what, description=what)
    commands = ca.add_subparsers(dest="ca_command", required=True, metavar="COMMAND")

    init = _command(commands, "init", _init, "create the consortium CA in a new directory")
    init.add_argument("--name", required=True, help="the consortium's name, the CA certificate's subject")
    init.add_argument("--days", type=int, default=3650, help="validity of the CA (default: %(default)s)")

    server = _command(commands, "issue-server", _issue_server, "the aggregator's TLS certificate")
    server.add_argument(
        "--host", action="append", required=True, help="a DNS name or IP address silos dial; repeat for each"
    )
    _issue_options(server)

    silo = _command(commands, "issue-silo", _issue_silo, "a silo's client certificate")
    silo.add_argument("--silo-id", required=True, help=f"the silo's identity: {ID_RULE}")
    silo.add_argument(
        "--csr",
        type=Path,
        help="a request the silo made (python -m silo certificate-request): its key stays there",
    )
    _issue_options(silo)

    operator = _command(commands, "issue-operator", _issue_operator, "a certificate for `aggregator status`")
    operator.add_argument("--name", default="operator", help="the operator's name (default: %(default)s)")
    _issue_options(operator)

    renewal = "a new certificate beside the live one, which stays valid until the roster names the new one"
    silo_renewal = _command(commands, "renew-silo", _renew_silo, f"a silo's: {renewal}")
    silo_renewal.add_argument("--silo-id", required=True, help=f"the silo's identity: {ID_RULE}")
    silo_renewal.add_argument("--out", type=Path, required=True, help="where to write it (a new directory)")
    silo_renewal.add_argument("--days", type=int, default=825, help="validity (default: %(default)s)")
    silo_renewal.add_argument(
        "--csr",
        type=Path,
        help="a request from the silo (python -m silo certificate-request): it keeps its key",
    )
    server_renewal = _command(commands, "renew-server", _renew_server, f"the aggregator's: {renewal}")
    server_renewal.add_argument(
        "--host", action="append", required=True, help="a DNS name or IP address silos dial; repeat for each"
    )
    server_renewal.add_argument("--out", type=Path, required=True, help="where to write it (a new directory)")
    server_renewal.add_argument("--days", type=int, default=825, help="validity (default: %(default)s)")
    ca_renewal = _command(commands, "renew-ca", _renew_ca, "the CA certificate again: same key, new validity")
    ca_renewal.add_argument("--days", type=int, default=3650, help="validity (default: %(default)s)")

    revocation = _command(commands, "revoke", _revoke, "revoke a certificate; the aggregator reloads the CRL")
    target = revocation.add_mutually_exclusive_group(required=True)
    target.add_argument("--silo-id", help="revoke this silo's live certificate")
    target.add_argument("--serial", type=_serial, help="revoke the certificate with this hexadecimal serial")
    revocation.add_argument(
        "--roster",
        type=Path,
        help="the roster the aggregator serves: while a renewal is under way, revoke refuses a certificate "
        "it still names",
    )
    revocation.add_argument(
        "--expel", action="store_true", help="revoke even a certificate the roster still names"
    )

    _command(commands, "list", _list, "every certificate the CA issued")


def run_command(args: argparse.Namespace) -> int:
    """Run a `ca` or `roster` command: refusals and file-system errors (a directory that cannot be written)
    are one line on stderr, exit 2."""
    try:
        return args.run(args)
    except (FedltError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _command(
    commands: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], help_text: str
) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--dir", type=Path, required=True, help="the CA directory")
    parser.set_defaults(run=run)
    return parser


def _issue_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="where to write the certificate and key")
    parser.add_argument("--days", type=int, default=825, help="validity (default: %(default)s)")
    parser.add_argument(
        "--replace",
        action="store_true",
        help="revoke a live certificate for the same identity, overwrite files",
    )


def _serial(text: str) -> int:
    try:
        return int(text.replace(":", ""), 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a hexadecimal serial: {text!r}") from None


def _init(args: argparse.Namespace) -> int:
    paths = init_ca(args.dir, name=args.name, days=args.days)
    print(f"created the consortium CA {args.name!r}")
    _wrote(paths.certificate, "the CA certificate: every member needs it")
    _wrote(paths.key, "the CA key (mode 0600): keep it here, offline if you can; never send it")
    _wrote(paths.crl, "the revocation list the aggregator reads")
    _wrote(paths.index, "the record of issued certificates")
    print(f"next: ca issue-server --dir {args.dir} --out OUT --host HOST, then ca issue-silo for each silo")
    return 0


def _issue_server(args: argparse.Namespace) -> int:
    issued = issue_server(args.dir, args.out, hosts=args.host, days=args.days, replace=args.replace)
    return _issued(
        issued, "the aggregator's server certificate", "name these files in [server] of consortium.toml"
    )


def _issue_silo(args: argparse.Namespace) -> int:
    csr = _read(args.csr) if args.csr else None
    issued = issue_silo(
        args.dir, args.out, silo_id=args.silo_id, days=args.days, replace=args.replace, csr=csr
    )
    files = [CaPaths.of(args.dir).certificate, issued.certificate, *([issued.key] if issued.key else [])]
    _announce(issued, f"a certificate for silo {args.silo_id!r}")
    print('next, in this order (docs/operator.md, "2b. The roster"):')
    print("  1. name it in the roster (the aggregator admits, and silos trust, only the members it names):")
    print(
        "     python -m aggregator roster draft --consortium <id> --aggregator <aggregator.pem> "
        f"--silo {args.silo_id}={issued.certificate} --silo <id>=<certificate> ... --out roster.json"
    )
    print("     (a running consortium: add --previous <roster in force>; a quorum of its silos signs it)")
    print(f"  2. send {', '.join(map(str, files))} and roster.json to the silo over a channel you trust")
    return 0


def _renew_silo(args: argparse.Namespace) -> int:
    csr = _read(args.csr) if args.csr else None
    issued = renew_silo(args.dir, args.out, silo_id=args.silo_id, days=args.days, csr=csr)
    files = f"{issued.certificate} and {issued.key}" if issued.key else f"{issued.certificate}"
    _announce(issued, f"a renewed certificate for silo {args.silo_id!r}")
    _rotation_steps(issued, f"--silo {args.silo_id}={issued.certificate}", f"send {files} to the silo")
    return 0


def _renew_server(args: argparse.Namespace) -> int:
    issued = renew_server(args.dir, args.out, hosts=args.host, days=args.days)
    _announce(issued, "a renewed certificate for the aggregator")
    _rotation_steps(
        issued,
        f"--aggregator {issued.certificate}",
        "keep the files with the aggregator's; once the roster naming them is in [server] roster, point "
        "[server] certificate and key at them and restart the aggregator (silos reconnect by themselves)",
    )
    return 0


def _renew_ca(args: argparse.Namespace) -> int:
    paths = renew_ca(args.dir, days=args.days)
    cert = read_certificate(paths.certificate)
    print(f"renewed the consortium CA certificate, valid until {format_utc(cert.not_valid_after_utc)}")
    _wrote(
        paths.certificate, "the CA certificate (same key and name: every certificate it issued stays valid)"
    )
    print(
        f"next: give every member the new {paths.certificate} (silos: [connection] ca; the aggregator: "
        "[server] ca) and restart each at a convenient time, before the old one expires"
    )
    return 0


def _announce(issued: IssuedPaths, what: str) -> None:
    print(f"issued {what}, serial {issued.serial:x}, valid until {format_utc(issued.not_after)}")
    if issued.replaced is not None:
        print(f"revoked the certificate it replaces, serial {issued.replaced:x}")
    if issued.renews is not None:
        print(f"the certificate it renews, serial {issued.renews:x}, stays valid: the roster still names it")
    _wrote(issued.certificate, "the certificate")
    if issued.key is not None:
        _wrote(issued.key, "its private key (mode 0600)")


def _rotation_steps(issued: IssuedPaths, member: str, handover: str) -> None:
    """What follows a renewal, in order: the roster names exact certificates, so it changes by quorum."""
    old = f"{issued.renews:x}" if issued.renews is not None else "<old serial>"
    print('next, in this order (docs/operator.md, "Renewing and rotating certificates"):')
    print(f"  1. {handover}")
    print(
        f"  2. python -m aggregator roster draft --previous <roster in force> ... {member} ... "
        "--out next.json (every other member as before)"
    )
    print("  3. a quorum of the silos of the roster in force sign it: python -m silo roster sign next.json")
    print(
        "  4. python -m aggregator roster check --previous <roster in force> next.json, then make it [server]"
    )
    print("     roster (running silos adopt it at their next heartbeat)")
    print(f"  5. python -m aggregator ca revoke --dir <CA directory> --serial {old} --roster next.json")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read {path}: {exc.strerror}") from None


def _issue_operator(args: argparse.Namespace) -> int:
    issued = issue_operator(args.dir, args.out, name=args.name, days=args.days, replace=args.replace)
    status = (
        f"python -m aggregator status --config consortium.toml --cert {issued.certificate} --key {issued.key}"
    )
    return _issued(issued, f"a certificate for operator {args.name!r}", status)


def _issued(issued: IssuedPaths, what: str, next_step: str) -> int:
    _announce(issued, what)
    print(f"next: {next_step}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    roster = Roster.read(args.roster) if args.roster else None
    serial = revoke(args.dir, silo_id=args.silo_id, serial=args.serial, roster=roster, expel=args.expel)
    print(f"revoked serial {serial:x}")
    _wrote(
        CaPaths.of(args.dir).crl, "the new revocation list; a running aggregator uses it from its next call"
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    records = list_issued(args.dir)
    if not records:
        print("no certificates issued yet")
        return 0
    now = datetime.now(UTC)
    rows = [("serial", "kind", "id", "expires", "revoked")]
    for r in records:
        left = r.days_left(now)
        expires = format_utc(r.not_after) + (" (expired)" if r.not_after <= now else f" ({left} days left)")
        revoked = "-" if r.revoked_at is None else format_utc(r.revoked_at)
        rows.append((f"{r.serial:x}", r.kind, r.subject_id, expires, revoked))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _wrote(path: Path, what: str) -> None:
    print(f"  wrote {path}: {what}")
