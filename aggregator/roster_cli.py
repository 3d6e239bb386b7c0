"""`python -m aggregator roster ...`: draft the consortium's roster for silos to pin or sign, show one, and
check that silos will adopt a signed draft.

The operator drafts; the operator cannot make a roster count. `aggregator.ca_cli.run_command` runs these too.
The first version goes to every silo with its enrollment kit (each administrator checks the fingerprints out
of band before pinning it); every later version needs signatures from a quorum of the silos of the version
they hold (`python -m silo roster sign`), counting only members whose certificate is valid and not revoked.
Silos refuse a roster whose own quorum is not above their `policy.roster_quorum_above` (by default half of
its silos), so `draft` and `check` hold a roster to that floor too (`--quorum-above`).
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from fedlt.errors import FedltError
from privacy.pki.errors import PkiError
from privacy.pki.identity import RevocationList, RevokedSerials
from privacy.pki.roster import DEFAULT_QUORUM_ABOVE, Revocations, Roster, draft, minimum_quorum


def add_roster_parser(subparsers: argparse._SubParsersAction) -> None:
    what = "the consortium roster: draft a version for silos to pin or sign, or show one"
    roster = subparsers.add_parser("roster", help=what, description=what)
    commands = roster.add_subparsers(dest="roster_command", required=True, metavar="COMMAND")
    drafting = commands.add_parser("draft", help="write an unsigned roster from members' certificates")
    drafting.add_argument(
        "--consortium", required=True, help="the consortium id (consortium.toml [consortium] id)"
    )
    drafting.add_argument("--aggregator", type=Path, required=True, help="the aggregator's certificate (PEM)")
    drafting.add_argument(
        "--silo", action="append", default=[], metavar="ID=CERT", help="a silo's id and certificate; repeat"
    )
    drafting.add_argument("--previous", type=Path, help="the roster this version replaces")
    drafting.add_argument(
        "--quorum", type=int, default=0, help="signatures the next version needs (0: over 2/3)"
    )
    _floor_option(drafting)
    drafting.add_argument("--out", type=Path, required=True, help="where to write the draft")
    drafting.set_defaults(run=_draft)
    show = commands.add_parser("show", help="print a roster's members, fingerprints and signatures")
    show.add_argument("roster", type=Path)
    show.set_defaults(run=_show)
    check = commands.add_parser(
        "check",
        help="whether silos holding --previous will adopt a roster: its signatures against the quorum",
    )
    check.add_argument("--previous", type=Path, required=True, help="the roster in force (silos hold it)")
    check.add_argument("--ca", type=Path, help="the consortium CA certificate ([server] ca), to verify --crl")
    check.add_argument(
        "--crl",
        type=Path,
        help="the CRL the aggregator serves ([server] crl): signers it revokes do not count, as at silos",
    )
    _floor_option(check)
    check.add_argument("roster", type=Path, help="the signed draft")
    check.set_defaults(run=_check)


def _floor_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quorum-above",
        type=_fraction,
        default=DEFAULT_QUORUM_ABOVE,
        metavar="FRACTION",
        help="refuse a quorum not above this fraction of the silos: the silos' policy.roster_quorum_above "
        "(default: %(default)s, theirs)",
    )


def _fraction(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"a fraction from 0 up to (not including) 1, such as 1/2; got {text!r}"
        )
    return value


def _draft(args: argparse.Namespace) -> int:
    silos = []
    for entry in args.silo:
        silo_id, sep, path = entry.partition("=")
        if not sep or not silo_id or not path:
            raise FedltError(f"--silo takes ID=CERT, got {entry!r}")
        silos.append((silo_id, Path(path).read_bytes()))
    previous = Roster.read(args.previous) if args.previous else None
    roster = draft(
        args.consortium,
        aggregator=args.aggregator.read_bytes(),
        silos=silos,
        quorum=args.quorum,
        previous=previous,
    )
    _check_floor(roster, args.quorum_above)
    args.out.write_bytes(roster.to_json())
    print(roster.describe())
    print(f"  wrote {args.out}")
    if previous is None:
        print("next: send it to every silo with its enrollment kit ([connection] roster in silo.toml)")
    else:
        print(
            f"next: {previous.quorum} silos of v{previous.version} sign it (python -m silo roster sign), "
            f"check it (python -m aggregator roster check --previous {args.previous} {args.out}), then name "
            "it in [server] roster of consortium.toml; running silos adopt it at their next heartbeat"
        )
    return 0


def _check(args: argparse.Namespace) -> int:
    """Exit 0 if silos holding --previous would adopt the roster; else one line saying why not (exit 2)."""
    previous, successor = Roster.read(args.previous), Roster.read(args.roster)
    previous.check_successor(successor, revocations=_revocations(args))
    _check_floor(successor, args.quorum_above)
    print(
        f"{args.roster}: roster v{successor.version} follows v{previous.version} and carries enough valid "
        f"signatures of its silos ({previous.quorum} needed): silos will adopt it once it is [server] roster"
    )
    if args.crl is None:
        print(
            "  revocations were not checked: give --ca and --crl (the aggregator's [server] ca and crl), as "
            "silos count no signer the CA revoked"
        )
    return 0


def _revocations(args: argparse.Namespace) -> Revocations:
    """The aggregator's CRL, verified; without one, no signer counts as revoked (and `_check` says so)."""
    if (args.ca is None) != (args.crl is None):
        raise FedltError("--ca and --crl go together: a CRL counts only once the CA's signature on it checks")
    return RevokedSerials() if args.crl is None else RevocationList.load(args.ca, args.crl)


def _check_floor(roster: Roster, above: Fraction) -> None:
    try:
        roster.check_quorum(above=above)
    except PkiError as exc:
        raise FedltError(
            f"{exc}: silos whose policy.roster_quorum_above is {above} refuse it; draft it with --quorum "
            f"{minimum_quorum(len(roster.silo_ids), above)} or more (or give --quorum-above if every silo "
            "lowered its floor)"
        ) from None


def _show(args: argparse.Namespace) -> int:
    print(Roster.read(args.roster).describe())
    return 0
