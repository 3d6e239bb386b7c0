"""`python -m attacks.evaluate`: run the audit grid and write its report; exit 1 if an audited mode leaks.

    python -m attacks.evaluate                          # configs/audit.toml, report in runs/audit
    python -m attacks.evaluate --config my-grid.toml --out runs/my-audit
    python -m attacks.evaluate --attacks analytic moments --modes "secagg + tail guard"
    python -m attacks.evaluate --aggregator-data runs/consortium-demo/fedavg/aggregator-data \
        --public-data mnist5k

Exit codes: 0 the audit passed, 1 a leak crossed a threshold in an audited mode (an empirical ε above what
the ledger charged included), 2 a usage or configuration error (with the message, never a traceback), 3
nothing audited: no attack applies to what the store holds (or the grid's attacks and modes gave no
finding), which is no pass.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "audit.toml"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    args = _parser().parse_args(argv)
    from attacks.config import load_audit_config
    from fedlt.errors import FedltError

    try:
        config = load_audit_config(args.config)
        config = _narrowed(config, args)
        if args.aggregator_data is not None:
            return audit_deployment(
                config, args.aggregator_data, args.public_data, args.out, settings=args.consortium
            )
        if args.consortium is not None:
            raise ValueError("--consortium describes the store of --aggregator-data; give both")
        return run(config, args.out)
    except (FedltError, ValueError) as exc:  # a grid the data cannot serve, a folder without a store
        print(f"error: {exc}", file=sys.stderr)
        return 2


def audit_deployment(
    config, folder: Path, public_name: str | None, out: Path, *, settings: Path | None = None
) -> int:
    """The attacks that apply to what a real aggregator stored in `folder`, with the grid's thresholds;
    `settings`, its consortium.toml, names the consortium in the report."""
    from aggregator.store import DATABASE
    from attacks.aggregator_data import audit_stored, describe_store, read_aggregator_data
    from attacks.report import EXIT_CODES, console_summary, verdict, verdict_line, write_report
    from fedlt.data.embedded import load_embedded

    started = time.perf_counter()
    public = load_embedded(public_name) if public_name else None
    print(f"reading {folder / DATABASE}", flush=True)
    data = read_aggregator_data(folder)
    subject = describe_store(data, settings)
    print(subject.header, flush=True)
    findings = audit_stored(
        data, thresholds=config.thresholds, public=public, progress=lambda label: print(label, flush=True)
    )
    write_report(out, config, findings, time.perf_counter() - started, subject=subject)
    print(console_summary(findings))
    print(verdict_line(findings, subject, out / "report.md"))
    return EXIT_CODES[verdict(findings)]


def run(config, out: Path) -> int:
    from tqdm import tqdm

    from attacks.audit import ONCE, PER_MODE, REFERENCES, Audit, check_views
    from attacks.report import EXIT_CODES, console_summary, verdict, verdict_line, write_report
    from attacks.scenario import build_scenario

    check_views(config.modes)
    started = time.perf_counter()
    scenario = build_scenario(config, echo=lambda line: print(line, flush=True))
    audit = Audit(scenario)
    steps = [(attack, mode) for mode in config.modes for attack in config.attacks if attack in PER_MODE]
    once = [attack for attack in config.attacks if attack in ONCE]
    findings = []
    references = [run for attacks, run in REFERENCES if set(attacks) & set(config.attacks)]
    with tqdm(total=len(steps) + len(once) + len(references), unit="attack", file=sys.stdout) as bar:
        for reference in references:
            bar.set_description("calibration")
            findings += reference(audit)
            bar.update()
        for attack in once:
            bar.set_description(attack)
            findings += ONCE[attack](audit)
            bar.update()
        for attack, mode in steps:
            bar.set_description(f"{attack} · {mode.name}")
            findings += PER_MODE[attack](audit, mode)
            bar.update()
    write_report(out, config, findings, time.perf_counter() - started)
    print(console_summary(findings))
    print(verdict_line(findings, None, out / "report.md"))
    return EXIT_CODES[verdict(findings)]


def _narrowed(config, args: argparse.Namespace):
    """The grid cut down to the attacks and modes named on the command line, if any."""
    from attacks.config import ATTACKS

    if args.attacks:
        unknown = sorted(set(args.attacks) - set(ATTACKS))
        if unknown:
            raise ValueError(f"unknown attack(s) {unknown}; known: {', '.join(ATTACKS)}")
        config = replace(config, attacks=tuple(args.attacks))
    if args.modes:
        known = [m.name for m in config.modes]
        unknown = sorted(set(args.modes) - set(known))
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; the grid has: {', '.join(known)}")
        config = replace(config, modes=tuple(m for m in config.modes if m.name in args.modes))
    return config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attacks.evaluate",
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n\n")[-1],
    )
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the audit grid (TOML)")
    p.add_argument("--out", type=Path, default=Path("runs/audit"), help="the report folder")
    p.add_argument("--attacks", nargs="+", help="only these attacks")
    p.add_argument("--modes", nargs="+", help="only these modes (by name)")
    p.add_argument(
        "--aggregator-data", type=Path, help="audit what the aggregator with this data folder stored instead"
    )
    p.add_argument(
        "--public-data", help="an embedded dataset the auditor owns, to decode and score (--aggregator-data)"
    )
    p.add_argument(
        "--consortium",
        type=Path,
        help="the consortium.toml the aggregator ran with, to name the consortium in the report "
        "(--aggregator-data; default: one beside the data folder that names it)",
    )
    return p


if __name__ == "__main__":
    sys.exit(main())
