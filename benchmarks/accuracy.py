"""Accuracy of the long-tail methods against the baselines, over imbalance factors and seeds (simulator).

    python benchmarks/accuracy.py [--imbalance 10 50 100] [--seeds 0 1 2]
        [--methods fedavg fedprox ccvr creff redgrape sfd dflfs dflfs:strategy=wc] [--rounds 30]
        [--workers 2] [--runs benchmarks/runs/accuracy] [--write docs/BENCHMARKS.md] [--section NAME]
        [--set section.key=value ...] [--privacy plaintext|secagg|ckks] [--ray [ADDRESS]]

A method is a name, or a name with settings of its `[method]` table (TOML values): `sfd:aligner=false`,
`sfd:local_loss="ce"`, `dflfs:strategy="wc"` — the ablations and variants. A dotted setting belongs to
another section of the config: `dflfs:selection.strategy="mfsc"`. `--set selection.per_round=3` changes a
setting for every run (partial participation, for the MFSC ablation).

Every run is `fedlt.sim` with `configs/demo.toml` (LT MNIST-5k, α 0.5, 10 silos, full participation, the
demo's local training) and the method's default settings, changing only the method, the imbalance factor and
the seed. The reported accuracy is the evaluated model's after the last round (for post-hoc CCVR, after its
closing calibration round), on the balanced test split; the table gives mean ± sample standard deviation over
seeds. Runs are kept in --runs (in a folder named after --set, if given) and resumed from their checkpoints,
so an interrupted benchmark loses at most the round in flight. Workers run one torch thread each, so results
do not depend on --workers. The plot goes to docs/img/ with --write (the docs' table), otherwise beside the
runs, so trying other seeds leaves the docs' picture alone. `--privacy secagg` sums every run securely (the
compact ring's rounding, issue 17). `--ray [ADDRESS]` sends each run to a Ray cluster as a task of one CPU
(docs/ray.md): every node needs fedlt installed, and --runs on a shared file system for a grid to resume.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from matplotlib.figure import Figure

from fedlt.methods import METHODS
from fedlt.sim.backend import RETRIES, BackendConfig, BackendUnavailable, join_cluster
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import RunFolderError, run_simulation

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo.toml"
GROUPS = ("accuracy", "many", "medium", "few")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--imbalance", type=float, nargs="+", default=[10.0, 50.0, 100.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedprox", "ccvr", "creff", "redgrape"])
    p.add_argument("--section", default="accuracy-table", help="marker name of the section --write replaces")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help='one Ray task per run: on the cluster at ADDRESS ("auto": the one `ray start` runs here), or '
        "without ADDRESS on a local one of --workers CPUs (pip install 'fedlt[ray]')",
    )
    p.add_argument("--runs", type=Path, default=ROOT / "benchmarks" / "runs" / "accuracy")
    p.add_argument("--write", type=Path, help="Markdown file whose accuracy table section to replace")
    p.add_argument("--set", nargs="*", default=[], help="settings for every run, as section.key=value")
    p.add_argument(
        "--privacy",
        default="plaintext",
        choices=("plaintext", "secagg", "ckks"),
        help="the layer every run sums with; other than plaintext, runs are kept under --runs/<layer>",
    )
    args = p.parse_args(argv)
    try:
        for label in args.methods:
            settings_of(label, args.set)
    except ValueError as exc:
        p.error(str(exc))
    return args


def settings_of(label: str, common: list[str]) -> tuple[dict, dict]:
    """`name` or `name:key=value,...` as a `[method]` table, and the other sections' settings: dotted keys
    of the label and `common`."""
    name, _, settings = label.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    try:
        options = tomllib.loads("\n".join(settings.split(","))) if settings else {}
        tables = tomllib.loads("\n".join(common))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{label}: settings must be key=value TOML pairs ({exc})") from None
    for section, values in list(options.items()):
        if isinstance(values, dict):
            tables.setdefault(section, {}).update(options.pop(section))
    return {"name": name, **options}, tables


def run_one(
    method: str, common: list[str], imbalance: float, seed: int, rounds: int, privacy: str, out: Path
) -> dict:
    """One simulation in a worker process; returns its final evaluation and the seconds its rounds took."""
    torch.set_num_threads(1)
    flags = {"imbalance": imbalance, "seed": seed, "rounds": rounds, "privacy": privacy}
    table, tables = settings_of(method, common)
    config = load_sim_config(str(CONFIG), flags, method=table, tables=tables)
    result = run_simulation(config, out, echo=lambda _: None)
    final = result.metrics["rounds"][-1]
    errors = [r["coverage_error"] for r in result.metrics["rounds"] if "coverage_error" in r]
    return {
        "method": method,
        "imbalance": imbalance,
        "seed": seed,
        "rounds": final["round"],
        "seconds": round(sum(r["seconds"] for r in result.metrics["rounds"]), 1),  # also over resumes
        **({"coverage_error": statistics.mean(errors)} if errors else {}),
        **{g: final[g] for g in GROUPS},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = [(m, f, s) for f in args.imbalance for s in args.seeds for m in args.methods]
    started = time.perf_counter()
    runs = args.runs if args.privacy == "plaintext" else args.runs / args.privacy
    if args.set:  # runs under other common settings are other runs: a folder of their own
        runs = runs / folder(",".join(args.set))
    calls = [
        (run_one, (m, args.set, f, s, args.rounds, args.privacy, runs / f"if{f:g}" / folder(m) / f"s{s}"))
        for m, f, s in jobs
    ]
    try:
        results = run_in_pool(
            calls,
            args.workers,
            ray=args.ray,
            line=lambda r: (
                f"{r['method']:>9} IF {r['imbalance']:>5g} seed {r['seed']}: overall {r['accuracy']:.1%}, "
                f"few {pct(r['few'])} ({r['seconds']:.0f} s)"
            ),
        )
    except (RunFolderError, BackendUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    minutes = (time.perf_counter() - started) / 60
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{args.section}.json").write_text(json.dumps(results, indent=1))
    section = render(results, args, minutes)
    print("\n" + section)
    # the docs' picture only with the docs' table; any other invocation plots beside its runs
    plot(results, args, (ROOT / "docs" / "img" if args.write else runs) / f"{args.section}.png")
    if args.write:
        replace_section(args.write, section, args.section)
        print(f"wrote the table into {args.write}")
    return 0


def run_in_pool(
    calls: list[tuple[Callable, tuple]], workers: int, line: Callable[[dict], str], ray: str | None = None
) -> list[dict]:
    """Each (function, arguments) in a worker process, or as a Ray task on the cluster at `ray` ("": a local
    one of `workers` CPUs); prints `line(result)` as each run finishes."""
    if ray is not None:
        return run_on_ray(calls, BackendConfig(backend="ray", address=ray, threads=1, workers=workers), line)
    results = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(function, *arguments) for function, arguments in calls]
        try:
            for done, future in enumerate(as_completed(futures), 1):
                results.append(future.result())
                print(f"[{done}/{len(futures)}] {line(results[-1])}", flush=True)
        except BaseException:  # a failed run stops the benchmark now, not after every other run
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results


def run_on_ray(
    calls: list[tuple[Callable, tuple]], cluster: BackendConfig, line: Callable[[dict], str]
) -> list[dict]:
    """One Ray task of one CPU per run, so a grid fills every core of every node; a task whose node dies
    runs again elsewhere (it resumes from its run folder's checkpoint if that folder is shared)."""
    ray, started = join_cluster(cluster)
    task = ray.remote(num_cpus=1, max_retries=RETRIES)
    pending = [task(function).remote(*arguments) for function, arguments in calls]
    results = []
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results.append(ray.get(done[0]))
            print(f"[{len(results)}/{len(calls)}] {line(results[-1])}", flush=True)
    finally:
        if started:
            ray.shutdown()
    return results


def summary(results: list[dict], method: str, imbalance: float, group: str) -> tuple[float, float] | None:
    return mean_sd([r[group] for r in results if r["method"] == method and r["imbalance"] == imbalance])


def mean_sd(values: list[float | None]) -> tuple[float, float] | None:
    """Mean and sample standard deviation over seeds; None if any run has no value."""
    if not values or any(v is None for v in values):
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def render(results: list[dict], args: argparse.Namespace, minutes: float) -> str:
    command = (
        "python benchmarks/accuracy.py"
        + f" --imbalance {' '.join(f'{f:g}' for f in args.imbalance)}"
        + f" --seeds {' '.join(map(str, args.seeds))} --methods {shlex.join(args.methods)}"
        + f" --rounds {args.rounds} --workers {args.workers}"
        + (f" --set {shlex.join(args.set)}" if args.set else "")
        + (f" --privacy {args.privacy}" if args.privacy != "plaintext" else "")
        + ("" if args.ray is None else " --ray" + (f" {args.ray}" if args.ray else ""))
    )
    lines = [
        f"<!-- {args.section}:start -->",
        f"Command: `{command}` ({minutes:.0f} min of wall time). Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"one torch thread per run. Date: {datetime.date.today().isoformat()}.",
        "",
        f"Mean ± standard deviation over seeds {', '.join(map(str, args.seeds))} of test accuracy after the "
        "last round; few-shot = classes with fewer than 20 training samples (none at IF 10).",
        "",
        "| IF | method | overall | many | medium | few | s/round |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in args.imbalance:
        base = summary(results, "fedavg", f, "accuracy")
        for m in args.methods:
            cells = [cell(summary(results, m, f, g)) for g in GROUPS]
            mark = ""
            if base and m != "fedavg":
                mine = summary(results, m, f, "accuracy")
                mark = f" ({(mine[0] - base[0]) * 100:+.1f})" if mine else ""
            pace = [r["seconds"] / r["rounds"] for r in results if r["method"] == m and r["imbalance"] == f]
            row = [f"{cells[0]}{mark}", *cells[1:], f"{statistics.median(pace):.1f}"]
            lines.append(f"| {f:g} | {m} | {' | '.join(row)} |")
    lines += [
        "",
        "In brackets: the difference in mean overall accuracy to FedAvg, in points. s/round: median over "
        "seeds of a run's seconds per round (training, sums and evaluation) on one torch thread.",
    ]
    scored = [m for m in args.methods if any("coverage_error" in r for r in results if r["method"] == m)]
    for m in scored:
        errors = [r["coverage_error"] for r in results if r["method"] == m and "coverage_error" in r]
        lines.append(
            f"{m}: MFSC misjudged {statistics.mean(errors):.1%} of (silo, class) pairs, mean over rounds "
            "and runs (scored by the simulator, which knows every silo's classes)."
        )
    lines.append(f"<!-- {args.section}:end -->")
    return "\n".join(lines)


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, 2, sharey=True)
    width = 0.8 / len(args.methods)
    for ax, group, title in zip(axes, ("accuracy", "few"), ("overall", "few-shot classes"), strict=True):
        for i, m in enumerate(args.methods):
            stats = [summary(results, m, f, group) for f in args.imbalance]
            xs = [k + i * width for k, s in enumerate(stats) if s]
            ax.bar(
                xs,
                [s[0] * 100 for s in stats if s],
                width,
                yerr=[s[1] * 100 for s in stats if s],
                label=m,
                capsize=2,
            )
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(args.imbalance))])
        ax.set_xticklabels([f"IF {f:g}" for f in args.imbalance])
        ax.set_title(f"LT {dataset_of(args)}, {title}")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def dataset_of(args: argparse.Namespace) -> str:
    """The data set every run uses: `--set data.dataset=...`, else the config's."""
    chosen = tomllib.loads("\n".join(args.set)).get("data", {}).get("dataset")
    return chosen or tomllib.loads(CONFIG.read_text())["data"]["dataset"]


def replace_section(path: Path, section: str, name: str) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text()
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def folder(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)


def cell(stat: tuple[float, float] | None) -> str:
    return "—" if stat is None else f"{stat[0]:.1%} ± {stat[1] * 100:.1f}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    sys.exit(main())
