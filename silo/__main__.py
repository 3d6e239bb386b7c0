"""`python -m silo run --config silo.toml`: run this silo's agent until the consortium finishes."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from fedlt.errors import FedltError
from silo.agent import SiloAgent
from silo.config import load_silo_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="connect to the aggregator and take part in rounds")
    run.add_argument("--config", required=True, help="silo.toml")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return SiloAgent(load_silo_config(args.config), stop=stop).run()
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
