"""What re-training the head on real features would give a finished run: the head CReFF aims at.

    python benchmarks/head_ceiling.py RUN_FOLDER [RUN_FOLDER ...] [--per-class 1000] [--epochs 30]

CReFF keeps FedAvg's backbone and re-trains its classifier on federated features whose head gradients match
those of the silos' real features, so the head it can hope for is one re-trained on the real features
themselves. This measures that head with an oracle no federated method has (it sees all the data): every
silo's real training features from the final backbone, resampled to `--per-class` per class, and the head
re-trained on them with cross-entropy, from the run's own head and from a fresh one. Methods that spread the
tail classes' features (CCVR's Gaussians) can end above it: a class of 4 records gives 4 distinct features.

A run folder is one `fedlt.sim` run (`config.toml` and `checkpoint.pt`), e.g. one of
`benchmarks/accuracy.py`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from fedlt.data.federation import build_federation
from fedlt.errors import FedltError
from fedlt.methods import GlobalState
from fedlt.methods.heads import extract_features, fresh_head, head_of, retrain_head, with_head
from fedlt.metrics import evaluate
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import CHECKPOINT, make_method

LR, MOMENTUM, BATCH = 0.01, 0.9, 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="fedlt.sim run folders")
    p.add_argument("--per-class", type=int, default=1000, help="resampled real features per class")
    p.add_argument("--epochs", type=int, default=30, help="epochs of head re-training")
    return p.parse_args(argv)


def ceiling(run: Path, per_class: int, epochs: int) -> dict[str, dict]:
    """The run's final evaluated model, and its backbone with heads re-trained on real balanced features."""
    config = load_sim_config(str(run / "config.toml"), {})
    federation = build_federation(config.data, seed=config.seed)
    method = make_method(config, federation.test.input_shape, len(federation.classes))
    saved = torch.load(run / CHECKPOINT, weights_only=True)
    state = GlobalState(saved["round"], saved["model"], saved["extra"])
    groups = config.metrics.groups(federation.train_counts)
    evaluated = method.eval_model(state)
    reports = {"run": evaluate(evaluated, federation.test, groups)}

    backbone = method.load(state.model)
    x = np.concatenate([s.x for s in federation.silos])
    y = torch.from_numpy(np.concatenate([s.y for s in federation.silos]))
    z = extract_features(backbone, torch.from_numpy(x))
    generator = torch.Generator().manual_seed(config.seed)
    picks = resampled(y, per_class, generator)
    starts = {
        "trained head": head_of(state.model),
        "fresh head": fresh_head(z.shape[1], len(federation.classes), generator),
    }
    for name, (weight, bias) in starts.items():
        weight, bias = retrain_head(
            z[picks],
            y[picks],
            weight,
            bias,
            epochs=epochs,
            lr=LR,
            batch_size=BATCH,
            generator=generator,
            momentum=MOMENTUM,
        )
        reports[name] = evaluate(method.load(with_head(state.model, weight, bias)), federation.test, groups)
    return reports


def resampled(y: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """`per_class` indices of every class present, drawn with replacement (a class of 4 repeats its 4)."""
    members = [torch.nonzero(y == c).flatten() for c in torch.unique(y).tolist()]
    return torch.cat([m[torch.randint(len(m), (per_class,), generator=generator)] for m in members])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for run in args.runs:
        if not (run / CHECKPOINT).exists() or not (run / "config.toml").exists():
            print(
                f"error: {run} is not a fedlt.sim run folder (config.toml and {CHECKPOINT})", file=sys.stderr
            )
            return 2
    torch.set_num_threads(1)
    for run in args.runs:
        try:
            reports = ceiling(run, args.per_class, args.epochs)
        except FedltError as exc:  # e.g. a run folder whose config.toml this version no longer accepts
            print(f"error: {run}: {exc}", file=sys.stderr)
            return 2
        for name, report in reports.items():
            few = "—" if report["few"] is None else f"{report['few']:.1%}"
            print(f"{run}  {name:>12}: overall {report['accuracy']:.1%}, few {few}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
