"""Differential privacy: accuracy of the methods at several budgets, and what DP-SGD costs in time.

    python benchmarks/dp.py [--epsilons 1 4 8 inf] [--seeds 0 1 2]
        [--methods fedavg creff sfd:scl_weight=0 dflfs] [--rounds 10] [--silos 4]
        [--lr 0.2] [--lr-no-dp 0.05] [--workers 2]
        [--runs benchmarks/runs/dp] [--write docs/BENCHMARKS.md] [--timing-repeats 5]
        [--timing-only | --runs-only | --from-runs]

Every run is `fedlt.sim` with `configs/demo.toml` (LT MNIST-5k, IF 100, α 0.5, the demo's local training)
with `--silos` silos, one local epoch, `--rounds` rounds, and `[dp] enabled = true, epsilon = ε` (`inf`: no
DP). Four silos rather than the demo's ten: DP guards each silo's records with that silo's own noise, and ten
silos of LT MNIST-5k hold 20 to 300 records each, too few for any useful model at these budgets. Under DP the
learning rate is `--lr`, four times the demo's, because DP-SGD's clipped updates are smaller (with 0.05 the
model barely left the majority class at ε = 4); without DP it is the demo's `--lr-no-dp` (0.2 with momentum
0.9 made some runs without DP diverge).

Each silo picks its DP-SGD σ so that its whole plan — its noised class counts, the method's statistics
releases (noised to half of ε) and every round's DP-SGD steps — spends ε at δ = 1e-5; the table reports the
largest ε any silo's ledger holds at the end, which the ledger never lets exceed the budget. SFD runs without
its supervised contrastive term at every ε (under DP it would tie each record's gradient to its batch). Runs
are kept in --runs and resumed from their checkpoints.

The timing part trains one silo's data (the largest of seed 0's split) with the demo's McMahan CNN, plainly
and with DP-SGD (σ = 1, the same batches' expected size), alternating the two `--timing-repeats` times in
this one process, with 1 and then 2 torch threads, and reports the medians and their ratio. `--timing-only`
measures (and writes) just that, on a machine left quiet for it, and `--runs-only` just the accuracy runs;
`--from-runs` tabulates the finished runs without running anything (an interrupted grid has gaps).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from accuracy import CONFIG, ROOT, cell, folder, mean_sd, pct, replace_section, run_in_pool, settings_of
from matplotlib.figure import Figure

from fedlt.data.federation import build_federation
from fedlt.dp import DPSettings
from fedlt.methods import METHODS
from fedlt.methods.local import train_local
from fedlt.methods.posthoc import PostHocHead
from fedlt.models import build_model
from fedlt.seeding import torch_generator
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import run_simulation
from privacy.dp import Budget, PrivacyLedger, SiloPrivacy
from privacy.dp.noise import SecureRandom

SECTION = "dp"
TIMING_SECTION = "dp-timing"
GROUPS = ("accuracy", "few")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0, math.inf])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=["fedavg", "creff", "sfd:scl_weight=0", "dflfs"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--silos", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.2, help="local learning rate under DP")
    p.add_argument("--lr-no-dp", type=float, default=0.05, help="local learning rate without DP (the demo's)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timing-repeats", type=int, default=5)
    p.add_argument("--runs", type=Path, default=ROOT / "benchmarks" / "runs" / "dp")
    p.add_argument("--write", type=Path, help="Markdown file whose DP sections to replace")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--timing-only", action="store_true", help="only time DP-SGD against plain training")
    mode.add_argument("--runs-only", action="store_true", help="only the accuracy runs, no timing")
    mode.add_argument("--from-runs", action="store_true", help="tabulate the finished runs, run nothing")
    args = p.parse_args(argv)
    try:
        for label in args.methods:
            settings_of(label, [])
    except ValueError as exc:
        p.error(str(exc))
    return args


def run_one(method: str, epsilon: float, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One simulation in a worker process: its final accuracy and the largest ε a silo spent."""
    torch.set_num_threads(1)
    table, tables = settings_of(method, [])
    tables.setdefault("train", {}).update(
        local_epochs=1, lr=args.lr if math.isfinite(epsilon) else args.lr_no_dp
    )
    tables["dp"] = {
        "enabled": math.isfinite(epsilon),
        **({"epsilon": epsilon} if math.isfinite(epsilon) else {}),
    }
    flags = {"imbalance": 100.0, "seed": seed, "rounds": args.rounds, "silos": args.silos}
    config = load_sim_config(str(CONFIG), flags, method=table, tables=tables)
    result = run_simulation(config, out, echo=lambda _: None)
    final = result.metrics["rounds"][-1]
    spent = max((r.get("epsilon_spent", 0.0) for r in result.metrics["rounds"]), default=0.0)
    return {
        "method": method,
        "epsilon": epsilon,
        "seed": seed,
        "spent": spent if math.isfinite(epsilon) else math.inf,
        "seconds": round(sum(r["seconds"] for r in result.metrics["rounds"]), 1),
        **{g: final[g] for g in GROUPS},
    }


def timing(repeats: int, threads: int) -> dict:
    """Medians of plain and DP-SGD local training of one silo's data, alternated in this process."""
    torch.set_num_threads(threads)
    config = load_sim_config(str(CONFIG), {"imbalance": 100.0, "silos": 4})
    data = max(build_federation(config.data, seed=0).silos, key=len)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    train = replace(config.train, local_epochs=1, lr=0.2)
    dp = DPSettings(enabled=True, epsilon=1e6, noise_multiplier=1.0)
    times: dict[str, list[float]] = {"plain": [], "dp-sgd": []}
    for k in range(repeats + 1):  # the first pair warms up and is dropped
        for kind in times:
            model = build_model("cnn", input_shape=data.input_shape, num_classes=10, seed=k)
            private = None
            if kind == "dp-sgd":
                ledger = PrivacyLedger(Budget(dp.epsilon, dp.delta))
                private = SiloPrivacy(dp, method=_Plan(), ledger=ledger, rng=SecureRandom())
            started = time.perf_counter()
            train_local(model, x, y, train, torch_generator(k, "timing"), private=private)
            if k:
                times[kind].append(time.perf_counter() - started)
    plain, private = statistics.median(times["plain"]), statistics.median(times["dp-sgd"])
    return {
        "threads": threads,
        "records": len(y),
        "plain": plain,
        "dp-sgd": private,
        "ratio": private / plain,
    }


class _Plan:
    """What SiloPrivacy asks of a method: a one-round plan with no statistics releases."""

    rounds = 1

    @staticmethod
    def statistics_plan() -> tuple[tuple, int]:
        return (), 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.from_runs or args.runs_only):
        timings = [timing(args.timing_repeats, threads) for threads in (1, 2)]
        section = render_timing(timings, args)
        print(section)
        if args.write:
            replace_section(args.write, section, TIMING_SECTION)
        if args.timing_only:
            return 0
    if args.from_runs:
        results, minutes = finished_runs(args), None
    else:
        started = time.perf_counter()
        results = run_all(args)
        minutes = (time.perf_counter() - started) / 60
        (args.runs / "results.json").write_text(json.dumps({"runs": results}, indent=1))
    section = render(results, args, minutes)
    print("\n" + section)
    plot(results, args, ROOT / "docs" / "img" / "dp-accuracy.png")
    if args.write:
        replace_section(args.write, section, SECTION)
        print(f"wrote the tables into {args.write}")
    return 0


def finished_runs(args: argparse.Namespace) -> list[dict]:
    """The runs of this grid that have finished, read from their folders (an interrupted benchmark's
    table has gaps, never guesses); the unfinished ones are listed."""
    results = []
    for m, e, s in jobs_of(args):
        path = run_folder(args, m, e, s) / "metrics.json"
        rounds = json.loads(path.read_text())["rounds"] if path.exists() else []
        closing = issubclass(METHODS[m.partition(":")[0]], PostHocHead)
        if len(rounds) < args.rounds + closing:
            print(f"not finished: {m} ε {e:g} seed {s}")
            continue
        spent = max((r.get("epsilon_spent", 0.0) for r in rounds), default=0.0)
        results.append(
            {
                "method": m,
                "epsilon": e,
                "seed": s,
                "spent": spent if math.isfinite(e) else math.inf,
                **{g: rounds[-1][g] for g in GROUPS},
            }
        )
    return results


def jobs_of(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    return [(m, e, s) for e in args.epsilons for s in args.seeds for m in args.methods]


def run_folder(args: argparse.Namespace, method: str, epsilon: float, seed: int) -> Path:
    return args.runs / f"eps{epsilon:g}" / folder(method) / f"s{seed}"


def run_all(args: argparse.Namespace) -> list[dict]:
    calls = [(run_one, (m, e, s, args, run_folder(args, m, e, s))) for m, e, s in jobs_of(args)]
    results = run_in_pool(
        calls,
        args.workers,
        lambda r: (
            f"{r['method']:>16} ε {r['epsilon']:>4g} seed {r['seed']}: overall {r['accuracy']:.1%}, "
            f"few {pct(r['few'])}, spent ε {r['spent']:.3g} ({r['seconds']:.0f} s)"
        ),
    )
    args.runs.mkdir(parents=True, exist_ok=True)
    return results


def summary(results: list[dict], method: str, epsilon: float, key: str) -> tuple[float, float] | None:
    return mean_sd([r[key] for r in results if r["method"] == method and r["epsilon"] == epsilon])


def machine() -> str:
    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}. Date: {datetime.date.today().isoformat()}."
    )


def render_timing(timings: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"<!-- {TIMING_SECTION}:start -->",
        f"Command: `python benchmarks/dp.py --timing-only --timing-repeats {args.timing_repeats}`. "
        + machine(),
        "",
        "**DP-SGD against plain local training** (one silo's data, the McMahan CNN, one local epoch, median "
        f"of {args.timing_repeats} alternated runs each, in one process):",
        "",
        "| torch threads | records | plain | DP-SGD | DP-SGD / plain |",
        "|---|---|---|---|---|",
    ]
    for t in timings:
        times = f"{t['plain']:.2f} s | {t['dp-sgd']:.2f} s | {t['ratio']:.2f}"
        lines.append(f"| {t['threads']} | {t['records']} | {times} |")
    lines.append(f"<!-- {TIMING_SECTION}:end -->")
    return "\n".join(lines)


def render(results: list[dict], args: argparse.Namespace, minutes: float | None) -> str:
    command = (
        f"python benchmarks/dp.py --epsilons {' '.join(f'{e:g}' for e in args.epsilons)}"
        f" --seeds {' '.join(map(str, args.seeds))} --methods {' '.join(args.methods)}"
        f" --rounds {args.rounds} --silos {args.silos} --lr {args.lr:g} --lr-no-dp {args.lr_no_dp:g}"
        f" --workers {args.workers}"
    )
    took = f" ({minutes:.0f} min of wall time)" if minutes is not None else ""
    lines = [
        f"<!-- {SECTION}:start -->",
        f"Command: `{command}`{took}. {machine()} One torch thread per run.",
        "",
        f"**Accuracy** on LT MNIST-5k (IF 100, {args.silos} silos, {args.rounds} rounds), mean ± standard "
        f"deviation over seeds {', '.join(map(str, args.seeds))}; few-shot = classes with fewer than 20 "
        "training samples; spent = the largest ε (δ = 1e-5) any silo's ledger holds at the end, mean over "
        "seeds.",
        "",
        "| method | ε | overall | few | spent ε |",
        "|---|---|---|---|---|",
    ]
    for m in args.methods:
        for e in args.epsilons:
            overall, few = summary(results, m, e, "accuracy"), summary(results, m, e, "few")
            spent = summary(results, m, e, "spent") if math.isfinite(e) else None
            budget = f"{e:g}" if math.isfinite(e) else "∞ (no DP)"
            lines.append(
                f"| {m} | {budget} | {cell(overall)} | {cell(few)} | "
                f"{'—' if spent is None else f'{spent[0]:.2f}'} |"
            )
    lines.append(f"<!-- {SECTION}:end -->")
    return "\n".join(lines)


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, 2, sharey=True)
    positions = list(range(len(args.epsilons)))
    for ax, group, title in zip(axes, GROUPS, ("overall", "few-shot classes"), strict=True):
        for m in args.methods:
            stats = [summary(results, m, e, group) for e in args.epsilons]
            xs = [p for p, s in zip(positions, stats, strict=True) if s]
            ys = [s[0] * 100 for s in stats if s]
            errs = [s[1] * 100 for s in stats if s]
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=m)
        ax.set_xticks(positions)
        ax.set_xticklabels([f"ε = {e:g}" if math.isfinite(e) else "no DP" for e in args.epsilons])
        ax.set_title(f"LT MNIST-5k IF 100, {title}")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
