"""SFD's server-side cost: feature synthesis (SAFS) for every class against a training round, same process.

    python benchmarks/sfd_synthesis.py [--repeats 3] [--imbalance 100] [--checkpoint RUN/checkpoint.pt]
        [--set rff_features=1000 ...] [--paper-round] [--aligner-check]

The federation and training are `configs/demo.toml`'s (LT MNIST-5k, 10 silos, the McMahan CNN, 512-d
features) with SFD at its default settings unless `--set` changes one. Each repeat times, one after the other:
a whole training round as the simulator runs it (the 10 silos' ABBL local rounds, the sum, the server
step), and the closing round's server half split into SAFS (all classes' synthesis) and the head's
fine-tuning, on the statistics of the model in --checkpoint (an SFD run folder's; default: the initial
model). Medians over repeats, and the ratio synthesis / training round of each repeat.

`--paper-round` instead times the same against a round in the shape of the papers' CIFAR-10-LT setting
(IF 100: 12,406 images of 3×32×32, 10 silos, 5 local epochs, batch 64) with CReFF's and DFL-FS's ResNet-8
(256-d features; SFD itself uses a ResNet-18, heavier in both halves). Images are random: time does not depend
on their content. The round's time is one silo's ABBL epoch over a tenth of the images, timed, times 10 silos
and 5 epochs; the synthesis runs on the statistics of those images under the initial ResNet-8.

`--aligner-check` also synthesises every class's features with and without the MeanCov aligner (SFD's
ablation) and prints how far each lands from the class statistics: the L1 random-feature MMD of Eq. 15, the
distance of the synthetic mean from the class mean, and the mean norm of synthetic against real features.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

from fedlt.aggregation import Sums, make_layer
from fedlt.data.arrays import LabeledData
from fedlt.data.federation import build_federation
from fedlt.data.longtail import longtail_counts
from fedlt.methods import GlobalState, ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.safs import SynthesisSettings, synthesize_class
from fedlt.methods.sfd import SFD, SFDOptions
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import make_method

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--imbalance", type=float, default=100.0)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--set", nargs="*", default=[], help="SFD settings as key=value (TOML values)")
    p.add_argument(
        "--aligner-check", action="store_true", help="compare synthesis with and without the aligner"
    )
    p.add_argument("--paper-round", action="store_true", help="against a CIFAR-10-LT-sized ResNet-8 round")
    args = p.parse_args(argv)
    options = tomllib.loads("\n".join(args.set))
    if args.paper_round:
        return paper_round(args, options)
    config = load_sim_config(
        str(ROOT / "configs" / "demo.toml"), {"imbalance": args.imbalance}, method={"name": "sfd", **options}
    )
    federation = build_federation(config.data, seed=config.seed)
    method = make_method(config, federation.test.input_shape, len(federation.classes))
    layer = make_layer("plaintext")
    trained = method.init_state(seed=config.seed)
    if args.checkpoint:
        saved = torch.load(args.checkpoint, weights_only=True)
        trained = GlobalState(saved["round"], saved["model"], {"trained": torch.tensor(config.rounds)})
    closing = GlobalState(config.rounds, trained.model, {"trained": torch.tensor(config.rounds)})
    start = method.init_state(seed=config.seed)
    ctx = ServerContext(config.rounds + 1, config.seed)
    rows = []
    contributions = [
        method.local_round(closing, silo, SiloContext(ctx.round, f"silo-{k}", config.seed))
        for k, silo in enumerate(federation.silos)
    ]
    sums = layer.aggregate(method.schema(closing), contributions)
    for repeat in range(args.repeats):
        began = time.perf_counter()
        contributions = [
            method.local_round(start, silo, SiloContext(1, f"silo-{k}", config.seed))
            for k, silo in enumerate(federation.silos)
        ]
        method.server_step(start, layer.aggregate(method.schema(start), contributions), ServerContext(1, 0))
        training = time.perf_counter() - began
        began = time.perf_counter()
        features, labels = method.synthetic_features(sums, ctx)
        synthesis = time.perf_counter() - began
        began = time.perf_counter()
        method.fine_tuned(closing.model, features, labels, torch.Generator().manual_seed(repeat))
        finetune = time.perf_counter() - began
        rows.append((training, synthesis, finetune, len(labels)))
        print(
            f"repeat {repeat + 1}: training round {training:.2f} s, synthesis {synthesis:.2f} s "
            f"({len(labels)} features, {int(sums['count'].gt(0).sum())} classes), "
            f"fine-tuning {finetune:.2f} s, "
            f"synthesis / round {synthesis / training:.1f}",
            flush=True,
        )
    if args.aligner_check:
        aligner_check(method, sums, ctx)
    if not rows:
        return 0
    median = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
    ratios = [r[1] / r[0] for r in rows]
    print(
        f"\nmachine {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; IF {args.imbalance:g}, settings {options or 'defaults'}\n"
        f"median of {args.repeats}: training round {median(0):.2f} s, synthesis {median(1):.2f} s, "
        f"fine-tuning {median(2):.2f} s, synthesis / round {statistics.median(ratios):.1f}"
    )
    return 0


PAPER_SILOS, PAPER_EPOCHS = 10, 5


def paper_round(args: argparse.Namespace, options: dict) -> int:
    spec = ModelSpec("resnet8", (3, 32, 32), 10)
    train = TrainConfig(local_epochs=1, batch_size=64, lr=0.01, momentum=0.9, weight_decay=1e-5)
    method = SFD(options=SFDOptions(**options), train=train, model=spec, rounds=1)
    counts = longtail_counts(5000, 10, args.imbalance)
    gen = torch.Generator().manual_seed(0)
    y = torch.repeat_interleave(torch.arange(10), torch.tensor(counts))
    images = LabeledData(
        torch.rand(len(y), 3, 32, 32, generator=gen).numpy(), y.numpy(), tuple(map(str, range(10)))
    )
    share = images.subset(torch.randperm(len(y), generator=gen)[: len(y) // PAPER_SILOS].numpy())
    start = method.init_state(seed=0)
    closing = GlobalState(1, start.model, {"trained": torch.tensor(1)})
    ctx = ServerContext(2, 0)
    sums = make_layer("plaintext").aggregate(
        method.schema(closing), [method.local_round(closing, images, SiloContext(2, "silo-0", 0))]
    )
    rows = []
    for repeat in range(args.repeats):
        began = time.perf_counter()
        method.local_round(start, share, SiloContext(1, "silo-0", 0))
        epoch = time.perf_counter() - began
        began = time.perf_counter()
        features, _ = method.synthetic_features(sums, ctx)
        synthesis = time.perf_counter() - began
        round_seconds = epoch * PAPER_SILOS * PAPER_EPOCHS
        rows.append((round_seconds, synthesis))
        print(
            f"repeat {repeat + 1}: one silo's epoch over {len(share)} images {epoch:.1f} s, so a round "
            f"≈ {round_seconds:.0f} s; synthesis {synthesis:.1f} s ({len(features)} features); "
            f"synthesis / round {synthesis / round_seconds:.3f}",
            flush=True,
        )
    print(
        f"\nmachine {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; ResNet-8, {len(y)} images, IF {args.imbalance:g}\n"
        f"median of {args.repeats}: round {statistics.median(r[0] for r in rows):.0f} s, synthesis "
        f"{statistics.median(r[1] for r in rows):.1f} s, synthesis / round "
        f"{statistics.median(r[1] / r[0] for r in rows):.3f}"
    )
    return 0


def aligner_check(method: SFD, sums: Sums, ctx: ServerContext) -> None:
    stats = method.pooled(sums, unbiased=False)
    rff = method.random_features(ctx.seed)
    print("\nclass  n    aligner  MMD-L1  |mean - class mean|  mean norm synthetic / real")
    for c in torch.nonzero(stats.present).flatten().tolist():
        target = sums["rff_sum"][c] / stats.counts[c]
        real_norm = (sums["outer_sum"][c][diagonal(stats.means.shape[1])].sum() / stats.counts[c]).sqrt()
        for aligner in (True, False):
            settings = SynthesisSettings(aligner=aligner, target_eps=method.options.target_eps)
            z = synthesize_class(
                600,
                stats.means[c],
                stats.covariances[c],
                target,
                rff,
                settings,
                torch.Generator().manual_seed(c),
            ).double()
            with torch.no_grad():
                mmd = float((target - rff(z).mean(0)).abs().sum())
            gap = float((z.mean(0) - stats.means[c]).norm())
            print(
                f"{c:>5}  {int(stats.counts[c]):>3}  {aligner!s:>7}  {mmd:6.3f}  {gap:18.3f}  "
                f"{float(z.norm(dim=1).mean()):.1f} / {float(real_norm):.1f}"
            )


def diagonal(dim: int) -> torch.Tensor:
    """Positions of the diagonal in the packed upper triangle: Σ‖z‖² per class is their sum."""
    rows, cols = torch.triu_indices(dim, dim)
    return rows == cols


if __name__ == "__main__":
    sys.exit(main())
