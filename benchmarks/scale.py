"""The simulator's round time on its backends: serial, and Ray with one and with two workers.

    python benchmarks/scale.py backends [--repeats 3] [--rounds 5] [--threads 1]
    python benchmarks/scale.py study [--silos 100] [--per-round 8] [--rounds 30] [--privacy secagg]
        [--method dflfs] [--selection mfsc] [--backends serial ray]

`backends`: the 10-silo demo (configs/demo.toml: FedAvg, LT MNIST-5k, IF 100, α 0.5, 2 local epochs), each
silo's work at `--threads` torch threads, run serially, on a local Ray cluster of one worker and of two, in
turn (serial, ray×1, ray×2, then again, `--repeats` times, so a drift of the machine favours none). A run's
round time is the median of its rounds after the first (the first also starts Ray's workers, which import
torch); each repeat compares the Ray runs with the serial run of the same repeat, and the report gives the
median of those ratios. Every run must end with the serial run's state digest, or the benchmark stops.

`study`: DFL-FS's setting, many small silos of which a few train each round (100 silos × 8 a round picked
by MFSC, LT MNIST-5k, IF 100, α 0.5, at least one image per silo, DFL-FS with its closing round in which
every silo sends its feature statistics), under secure aggregation, to completion on each backend of
`--backends`; reports the median round time of each, the closing round's, and checks that both end with the
same bits.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedlt.sim.config import SimConfig, load_sim_config
from fedlt.sim.run import run_simulation

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo.toml"
BACKENDS = {"serial": {"backend": "serial"}, "ray×1": {"backend": "ray", "workers": 1}}
BACKENDS["ray×2"] = {"backend": "ray", "workers": 2}


def run(config: SimConfig) -> tuple[list[float], str, float, dict]:
    """Each round's seconds, the final state's digest, the whole run's seconds and its last evaluation."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = run_simulation(config, Path(out), echo=lambda _: None)
    rounds = [r["seconds"] for r in result.metrics["rounds"]]
    return rounds, result.state.digest(), time.perf_counter() - started, result.metrics["rounds"][-1]


def backends(args: argparse.Namespace) -> None:
    flags = {"rounds": args.rounds, "threads": args.threads}
    times: dict[str, list[float]] = {name: [] for name in BACKENDS}
    ratios: dict[str, list[float]] = {name: [] for name in BACKENDS if name != "serial"}
    for repeat in range(args.repeats):
        digests = set()
        for name, setting in BACKENDS.items():
            rounds, digest, _, _ = run(load_sim_config(str(CONFIG), {**flags, **setting}))
            seconds = statistics.median(rounds[1:])  # the first also starts Ray's workers
            times[name].append(seconds)
            digests.add(digest)
            print(f"repeat {repeat + 1}: {name:>6} {seconds:.2f} s a round", flush=True)
        if len(digests) != 1:
            sys.exit(f"the backends ended with different states: {digests}")
        for name in ratios:
            ratios[name].append(times[name][-1] / times["serial"][-1])
    print(f"\n{machine()}; --rounds {args.rounds} --threads {args.threads}, {args.repeats} repeats")
    print("| backend | round time (median) | ÷ serial, same repeat (median, range) |\n|---|---|---|")
    for name, values in times.items():
        ratio = "1" if name == "serial" else spread(ratios[name])
        print(f"| {name} | {statistics.median(values):.2f} s | {ratio} |")


def study(args: argparse.Namespace) -> None:
    flags = {
        "silos": args.silos,
        "per_round": args.per_round,
        "rounds": args.rounds,
        "privacy": args.privacy,
        "threads": args.threads,
        "method": args.method,
        "selection": args.selection,
    }
    digests, lines = set(), []
    for name in args.backends:
        config = load_sim_config(
            str(CONFIG), {**flags, "backend": name}, tables={"data": {"min_silo_size": 1}}
        )
        rounds, digest, whole, final = run(config)
        digests.add(digest)
        seconds = statistics.median(rounds[1 : config.rounds])  # training rounds after the first
        lines.append(
            f"| {name} | {len(rounds)} | {seconds:.2f} s | {rounds[-1]:.1f} s | {whole / 60:.1f} min | "
            f"{final['accuracy']:.1%} / {final['few'] or 0:.1%} |"
        )
        print(f"{name}: {seconds:.2f} s a round, {whole:.0f} s in all", flush=True)
    print(f"\n{machine()}; {args.silos} silos × {args.per_round} a round, {args.method}, {args.privacy}")
    print(
        "| backend | rounds | training round (median) | last round | whole run | accuracy / few-shot |\n"
        "|---|---|---|---|---|---|"
    )
    print("\n".join(lines))
    if len(digests) != 1:
        sys.exit(f"the backends ended with different states: {digests}")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backends", help="the 10-silo demo's round time: serial, Ray with 1 and 2 workers")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("study", help="many silos, a few a round, under secure aggregation")
    s.add_argument("--silos", type=int, default=100)
    s.add_argument("--per-round", type=int, default=8)
    s.add_argument("--rounds", type=int, default=30)
    s.add_argument("--privacy", default="secagg")
    s.add_argument("--method", default="dflfs")
    s.add_argument("--selection", default="mfsc", help="how each round's silos are picked: random or mfsc")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--backends", nargs="+", default=["serial", "ray"], choices=("serial", "ray"))
    args = p.parse_args(argv)
    backends(args) if args.command == "backends" else study(args)


if __name__ == "__main__":
    main()
