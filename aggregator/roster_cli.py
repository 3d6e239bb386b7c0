"""`python -m aggregator roster ...`: draft the consortium's roster for silos to pin or sign, show one, and
check that silos will adopt a signed draft.

The operator drafts; the operator cannot make a roster count. `aggregator.ca_cli.run_command` runs these too.
The first version goes to every silo with its enrollment kit (each administrator checks the fingerprints out
of band before pinning it); every later version needs signatures from a quorum of the silos of the version
they hold (`python -m silo roster sign`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedlt.errors import FedltError
from privacy.pki.roster import Roster, draft


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
    check.add_argument("roster", type=Path, help="the signed draft")
    check.set_defaults(run=_check)


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
    previous.check_successor(successor)
    print(
        f"{args.roster}: roster v{successor.version} follows v{previous.version} and carries enough valid "
        f"signatures of its silos ({previous.quorum} needed): silos will adopt it once it is [server] roster"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    print(Roster.read(args.roster).describe())
    return 0
