"""`python -m fedlt.sim`: run a federated method on a simulated long-tailed consortium."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from fedlt.data.embedded import EMBEDDED
from fedlt.errors import FedltError
from fedlt.methods import METHODS
from fedlt.models import MODELS
from fedlt.sim.config import FLAG_KEYS, SimConfig, load_sim_config
from fedlt.sim.run import run_simulation


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fedlt.sim",
        description="Simulate a consortium of silos on long-tailed, non-IID data. Flags override --config.",
    )
    p.add_argument("--config", help="TOML file (see configs/demo.toml)")
    p.add_argument("--out", type=Path, help="run folder (default: runs/<method>-<dataset>-s<seed>)")
    p.add_argument("--fresh", action="store_true", help="discard an earlier run in --out instead of resuming")
    p.add_argument("--seed", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--method", help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--dataset", help=f"one of: {', '.join(EMBEDDED)}")
    p.add_argument("--imbalance", type=float, help="long-tail imbalance factor IF = n_max / n_min")
    p.add_argument("--alpha", type=float, help="Dirichlet α of the non-IID split")
    p.add_argument("--silos", type=int)
    p.add_argument("--local-epochs", type=int)
    p.add_argument("--device", help='where to train and evaluate: "auto", "cpu", "cuda" or "cuda:N"')
    models = "; ".join(f"{name} ({entry.doc})" for name, entry in MODELS.items())
    p.add_argument("--model", help=f"auto (by image size) or one of: {models}")
    p.add_argument("--privacy", help="privacy layer")
    p.add_argument("--per-round", type=int, help="silos that train in a round (0: all)")
    p.add_argument("--selection", help="how they are picked: random or mfsc (a per-silo disclosure)")
    p.add_argument(
        "--epsilon",
        type=float,
        help="differential privacy: each silo's (ε, δ = [dp] delta) budget; turns [dp] on",
    )
    p.add_argument("--backend", help="where each silo's work runs: serial (this process) or ray")
    p.add_argument("--address", help='ray: the cluster to join ("auto": the one `ray start` runs here)')
    p.add_argument("--threads", type=int, help="torch threads for each silo's work (0: backend's default)")
    p.add_argument("--workers", type=int, help="ray, local cluster: silos trained at once (0: one per core)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # force: Opacus configures the root logger when imported (opacus/utils/module_utils.py)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    flags = {k: getattr(args, k) for k in FLAG_KEYS}  # every flag that has a place in the settings
    try:
        config = load_sim_config(args.config, flags)
        out = args.out or Path("runs") / f"{config.method.name}-{config.data.dataset}-s{config.seed}"
        if args.fresh and out.exists():
            shutil.rmtree(out)
        return _run(config, out, quiet=args.quiet)
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(config: SimConfig, out: Path, *, quiet: bool) -> int:
    print(
        f"fedlt.sim: {config.method.name} on {config.data.dataset} (IF {config.data.imbalance:g}, "
        f"α {config.data.alpha:g}, {config.data.silos} silos), {config.rounds} rounds, "
        f"privacy layer {config.privacy!r} -> {out}"
    )
    bar = tqdm(total=config.rounds, unit="round", disable=quiet, file=sys.stderr, leave=False)
    try:
        result = run_simulation(
            config,
            out,
            echo=lambda line: tqdm.write(line, file=sys.stdout),
            on_round=lambda r, total, _entry: _advance(bar, r, total),
        )
    except KeyboardInterrupt:
        bar.close()
        print(
            f"\ninterrupted; completed rounds are saved in {out} — run the same command to resume",
            file=sys.stderr,
        )
        return 130
    bar.close()
    print(f"\nfinal test accuracy after round {result.state.round}:\n{result.table}")
    print(f"\nmetrics, plots and checkpoint in {out}/ (metrics.json, accuracy.png, per_class.png)")
    return 0


def _advance(bar: tqdm, done: int, total: int) -> None:
    """A method with a closing phase runs more rounds than `rounds`; the bar learns the total as it goes."""
    bar.total = total
    bar.update(done - bar.n)


if __name__ == "__main__":
    sys.exit(main())
