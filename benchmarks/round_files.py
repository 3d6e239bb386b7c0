"""How many of the project's files one consortium round runs through, on each side, under each layer.

A newcomer following a round reads every file it crosses; issue 32 asks that a round cross clearly fewer.
This starts a real consortium on this machine (an aggregator and three silo agents, one round of FedAvg on
the small digits recipe), each process under a profiling hook (`sys.setprofile`, every thread), and counts
the project files (fedlt/, privacy/, silo/, aggregator/; not the generated fedlt/v1) in which a function was
called (a module merely imported does not count), in the aggregator and in one silo: over the whole run
(start-up, the round, the shutdown) and from the round's start on (the aggregator building its RoundSpec,
the silo opening it: `privacy.roundspec.build` / `open_signed`, the same functions in 8bf3e2b, the
end of issue 31) to the process's exit.

    python benchmarks/round_files.py [--privacy secagg ckks] [--tree DIR] [--list]

`--tree DIR` runs the processes from another checkout (a `git worktree` of an older commit, for "before"),
with this checkout writing the configuration files; `--list` prints the files counted from the round on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from aggregator.config import ConsortiumSection, TimeoutSection
from aggregator.demo import demo_layer_settings, point_silos_at, wait_for_address, write_consortium
from fedlt.data.federation import DataConfig
from fedlt.methods import TrainConfig
from fedlt.plan import ModelSection, RoundPlan

RECIPE = DataConfig(dataset="digits", imbalance=10.0, alpha=0.5, silos=3, min_silo_size=10, test_per_class=30)
PLAN = RoundPlan(
    model=ModelSection(name="cnn-small", image_shape=(1, 8, 8)),
    train=TrainConfig(local_epochs=1, batch_size=16, lr=0.05, momentum=0.9),
)
PROJECT = ("fedlt", "privacy", "silo", "aggregator")
ROUND_STARTS = {"aggregator": "roundspec.py:build", "silo": "roundspec.py:open_signed"}


def traced(module: str, config: Path, out: Path) -> list[str]:
    """`python -m <module> serve|run --config <config>` under `trace`, its files written to `out`."""
    verb = "serve" if module == "aggregator" else "run"
    tracer = Path(__file__).with_name("trace_calls.py")
    return [sys.executable, str(tracer), str(out), ROUND_STARTS[module], module, verb, f"--config={config}"]


def project_files(out: Path, tree: Path, part: str) -> set[str]:
    """The project files of one traced process, relative to `tree`: `part` "whole" or "round"."""
    found = set()
    for path in json.loads(out.read_text())[part]:
        try:
            relative = Path(path).resolve().relative_to(tree.resolve())
        except ValueError:
            continue  # a library's file
        if relative.parts[0] in PROJECT and relative.parts[:2] != ("fedlt", "v1"):
            found.add(str(relative))
    return found


def one_round(privacy: str, tree: Path, work: Path) -> dict[str, Path]:
    """Run the consortium's round; the trace file of the aggregator and of each silo."""
    consortium, silo_configs = write_consortium(
        work,
        recipe=RECIPE,
        plan=PLAN,
        consortium=ConsortiumSection(id="files", rounds=1, min_silos=3, privacy=privacy),
        timeouts=TimeoutSection(gather=5.0, round=600.0),
        silo_threads=1,
        layer_settings=demo_layer_settings(privacy),
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    names = ("aggregator", "silo-0", "silo-1", "silo-2")
    outputs = {name: (work / f"{name}.log").open("w") for name in names}
    data = {name: work / f"{name}.json" for name in names}
    aggregator = subprocess.Popen(
        traced("aggregator", consortium, data["aggregator"]),
        cwd=tree,
        env=env,
        stdout=outputs["aggregator"],
        stderr=subprocess.STDOUT,
    )
    silos = []
    try:
        point_silos_at(wait_for_address(work / "aggregator-data", aggregator, timeout=600), silo_configs)
        for k, path in enumerate(silo_configs):
            silos.append(
                subprocess.Popen(
                    traced("silo", path, data[f"silo-{k}"]),
                    cwd=tree,
                    env=env,
                    stdout=outputs[f"silo-{k}"],
                    stderr=subprocess.STDOUT,
                )
            )
        if aggregator.wait(timeout=1800) != 0:
            raise SystemExit(f"the aggregator failed; see {work / 'aggregator.log'}")
        for silo in silos:
            silo.wait(timeout=300)
    finally:
        for process in [aggregator, *silos]:
            if process.poll() is None:
                process.kill()
        for out in outputs.values():
            out.close()
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--privacy", nargs="+", default=["secagg", "ckks"])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--list", action="store_true", help="print the files counted from the round on")
    args = parser.parse_args()
    print(f"tree: {args.tree}")
    for privacy in args.privacy:
        with tempfile.TemporaryDirectory() as work:
            data = one_round(privacy, args.tree, Path(work))
            counted = {
                side: {part: project_files(data[name], args.tree, part) for part in ("whole", "round")}
                for side, name in (("aggregator", "aggregator"), ("silo", "silo-0"))
            }
        (agg_round, agg_whole), (silo_round, silo_whole) = (
            (len(parts["round"]), len(parts["whole"])) for parts in counted.values()
        )
        print(
            f"{privacy}: from the round's start, aggregator {agg_round} files, silo {silo_round}; "
            f"over the whole run {agg_whole} and {silo_whole}"
        )
        if args.list:
            for side, parts in counted.items():
                print(f"  {side}: {', '.join(sorted(parts['round']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
