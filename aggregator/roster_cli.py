"""`python -m aggregator roster ...`: draft the consortium's roster for silos to pin or sign, and show one.

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
            "then name it in [server] roster of consortium.toml; silos adopt it when they next register"
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    print(Roster.read(args.roster).describe())
    return 0
