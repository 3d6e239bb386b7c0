"""How many of the project's files one consortium round runs through, on each side, under each layer.

A newcomer following a round reads every file it crosses; issue 32 asks that a round cross clearly fewer.
This starts a real consortium on this machine (an aggregator and three silo agents, one round of FedAvg on
the small digits recipe) with each process under coverage.py (a dev dependency), and counts the project
files (fedlt/, privacy/, silo/, aggregator/; not the generated fedlt/v1) in which a function ran (a file
only imported does not count): in the aggregator, and in one silo. The count covers the whole one-round run,
start-up included, so it is an upper bound on what the round itself needs; compare counts of one command.

    python benchmarks/round_files.py [--privacy secagg ckks] [--tree DIR] [--list]

`--tree DIR` runs the processes from another checkout (a `git worktree` of an older commit, for "before"),
with this checkout writing the configuration files; `--list` prints the files.
"""

from __future__ import annotations

import argparse
import ast
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


def traced(module: str, config: Path, data: Path, tree: Path) -> list[str]:
    """`python -m <module> serve|run --config <config>` under coverage.py, its data in `data`."""
    verb = "serve" if module == "aggregator" else "run"
    measure = ["-m", "coverage", "run", f"--data-file={data}", f"--include={tree.resolve()}/*"]
    return [sys.executable, *measure, "-m", module, verb, "--config", str(config)]


def project_files(data: Path, tree: Path) -> set[str]:
    """The project files in which a line ran, relative to `tree`."""
    report = data.with_suffix(".json")
    subprocess.run(
        [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(report), "-q"], check=True
    )
    found = set()
    for path, facts in json.loads(report.read_text())["files"].items():
        relative = Path(path).resolve().relative_to(tree.resolve())
        if relative.parts[0] not in PROJECT or relative.parts[:2] == ("fedlt", "v1"):
            continue
        if set(facts["executed_lines"]) & function_lines(Path(path)):
            found.add(str(relative))
    return found


def function_lines(path: Path) -> set[int]:
    """The lines of a module's function bodies: a file counts only if one of its functions ran, not when it
    was merely imported (its module-level lines run then)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            body = node.body if isinstance(node.body, list) else [node.body]
            for statement in body:
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def one_round(privacy: str, tree: Path, work: Path) -> tuple[set[str], set[str]]:
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
    data = {name: work / f"{name}.coverage" for name in names}
    aggregator = subprocess.Popen(
        traced("aggregator", consortium, data["aggregator"], tree),
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
                    traced("silo", path, data[f"silo-{k}"], tree),
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
    return project_files(data["aggregator"], tree), project_files(data["silo-0"], tree)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--privacy", nargs="+", default=["secagg", "ckks"])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--list", action="store_true", help="print the files too")
    args = parser.parse_args()
    print(f"tree: {args.tree}")
    for privacy in args.privacy:
        with tempfile.TemporaryDirectory() as work:
            aggregator, silo = one_round(privacy, args.tree, Path(work))
        print(f"{privacy}: aggregator {len(aggregator)} files, silo {len(silo)} files")
        if args.list:
            for side, files in (("aggregator", aggregator), ("silo", silo)):
                print(f"  {side}: {', '.join(sorted(files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
