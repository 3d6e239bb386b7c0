"""`python -m aggregator`: the consortium operator's commands (CA, roster, serve, status, study, export,
demo)."""

from __future__ import annotations

import os

# Idle OpenMP threads of a server that may share its machine should sleep, not spin: spinning threads
# slowed silo training on the same cores by half. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
import sys
from pathlib import Path

from aggregator.ca_cli import add_ca_parser, run_command
from aggregator.roster_cli import add_roster_parser
from aggregator.study_cli import add_operator_options, add_study_parser, run_study
from fedlt.aggregation import layer_names
from fedlt.aggregation.registry import DEFAULT_LAYER
from fedlt.errors import FedltError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aggregator", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    commands = parser.add_subparsers(dest="command", required=True)
    add_ca_parser(commands)
    add_roster_parser(commands)
    serve = commands.add_parser("serve", help="run the aggregator service")
    serve.add_argument("--config", required=True, help="consortium.toml")
    status = commands.add_parser("status", help="show a study's rounds and silos, and every study")
    add_operator_options(status)
    status.add_argument("--study", default="", help="the study to show (default: consortium.toml's)")
    add_study_parser(commands)
    export = commands.add_parser(
        "export", help="write a committed model as safetensors with a model card (the store is only read)"
    )
    export.add_argument("--config", required=True, help="consortium.toml")
    export.add_argument("--out", type=Path, required=True, help="a new or empty folder to write it to")
    export.add_argument("--round", type=int, help="the committed round to export (default: the last)")
    export.add_argument("--study", default="", help="the study to export from (default: consortium.toml's)")
    demo = commands.add_parser("demo", help="a whole consortium on this machine: CA, aggregator, silos")
    demo.add_argument("--dir", type=Path, default=Path("runs/consortium-demo"))
    demo.add_argument("--silos", type=int, default=4)
    demo.add_argument("--rounds", type=int, default=30)
    demo.add_argument(
        "--methods",
        nargs="+",
        help="one consortium run each, in turn, then their accuracies side by side (default: fedavg, then "
        "fedlt's long-tail recipe, balanced)",
    )
    demo.add_argument(
        "--privacy",
        default=DEFAULT_LAYER,
        choices=layer_names(),
        help="the privacy layer the demo runs (docs/threat-model.md: what each one hides)",
    )
    args = parser.parse_args(argv)
    # force: Opacus configures the root logger when imported (opacus/utils/module_utils.py)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True
    )
    try:
        if args.command in ("ca", "roster"):
            return run_command(args)
        if args.command == "serve":
            from aggregator.config import load_consortium_config
            from aggregator.server import serve as run_server

            return run_server(load_consortium_config(args.config))
        if args.command in ("status", "study"):
            return _operator_command(args)
        if args.command == "export":
            from aggregator.export import export_model

            return export_model(args.config, args.out, round_number=args.round, study=args.study)
        from aggregator.demo import DEMO_METHODS, run_demo

        return run_demo(
            args.dir,
            silos=args.silos,
            rounds=args.rounds,
            privacy=args.privacy,
            methods=args.methods or DEMO_METHODS,
        )
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _operator_command(args: argparse.Namespace) -> int:
    """`status` and `study ...`: a call the aggregator refuses or never answers is one line, exit 1."""
    from aggregator.status import NoAnswer, show_status

    try:
        if args.command == "study":
            return run_study(args)
        return show_status(args.config, cert=args.cert, key=args.key, address=args.address, study=args.study)
    except NoAnswer as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
