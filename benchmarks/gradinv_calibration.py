"""Gradient inversion's calibration: single records' plaintext gradients on the audit's model, inverted.

    python benchmarks/gradinv_calibration.py [--records 4] [--iterations 300] [--restarts 1]
        [--tv-weight 0.01] [--seed 0] [--threads 2] [--config configs/audit.toml]

The published attacks (DLG, iDLG, Inverting Gradients) are shown on the gradient of one record; an audit
whose gradient inversion fails on a realistic view means something only if the same attack, on the same
model, recovers that easy case. This measures it in the audit's setting (`attacks.scenario.build_scenario`
on --config: long-tailed MNIST-5k over 4 silos, the FedAvg-trained McMahan CNN the aggregator sends): from
the smallest silo (the one the audit's `gradinv` row attacks), --records records of distinct classes
(`attacks.gradinv.calibration_records`), each one's gradient (`record_gradient`) inverted on its own
(`invert_delta`, label by iDLG). Each reconstruction is scored against its record by SSIM and PSNR
(`attacks.scoring.per_image`), beside uniform noise and an unrelated image of the same class from the
attacker's public split: a reconstruction that only looks like the class scores no better than the latter.

Prints one line per record (wall and CPU seconds included), then the medians and the total wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from attacks.config import load_audit_config
from attacks.gradinv import (
    InversionSettings,
    calibration_records,
    invert_delta,
    labels_from_delta,
    record_gradient,
)
from attacks.scenario import build_scenario, method_for
from attacks.scoring import per_image, random_images
from fedlt.errors import FedltError

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = InversionSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=4, help="records inverted, each of its own class")
    p.add_argument("--iterations", type=int, default=defaults.iterations, help="Adam steps per restart")
    p.add_argument("--restarts", type=int, default=defaults.restarts, help="starts per record")
    p.add_argument("--tv-weight", type=float, default=defaults.tv_weight, help="total-variation weight")
    p.add_argument("--seed", type=int, default=0, help="draws the records and the starts")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "audit.toml", help="the audit grid")
    args = p.parse_args(argv)
    for name in ("records", "iterations", "restarts", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.tv_weight < 0:
        p.error(f"--tv-weight must be at least 0, got {args.tv_weight}")
    return args


def calibrate(args: argparse.Namespace) -> list[dict[str, float]]:
    """One row per calibration record: its class, the label iDLG read, scores, and the time it took."""
    settings = InversionSettings(iterations=args.iterations, tv_weight=args.tv_weight, restarts=args.restarts)
    scenario = build_scenario(load_audit_config(args.config), echo=lambda line: print(line, flush=True))
    model = method_for(scenario, "fedavg").load(scenario.state.model).eval()
    silos, public = scenario.federation.silos, scenario.public
    silo = silos[int(np.argmin([len(s) for s in silos]))]
    rng = np.random.default_rng(args.seed)
    rows = []
    for i in calibration_records(silo.y, args.records, seed=args.seed):
        record, label = silo.x[i : i + 1], int(silo.y[i])
        wall, cpu = time.perf_counter(), time.process_time()
        delta = record_gradient(model, record[0], label)
        found = int(labels_from_delta(model, delta, 1)[0])
        image = invert_delta(
            model, delta, count=1, image_shape=public.input_shape, settings=settings, seed=args.seed
        )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        same_class = public.x[[int(rng.choice(np.flatnonzero(public.y == label)))]]
        scores = per_image(record, image)
        rows.append(
            {
                "record": int(i),
                "class": label,
                "idlg_label": found,
                "ssim": float(scores["ssim"][0]),
                "psnr": float(scores["psnr"][0]),
                "ssim_random": float(per_image(record, random_images(record, args.seed))["ssim"][0]),
                "ssim_same_class": float(per_image(record, same_class)["ssim"][0]),
                "wall_s": wall,
                "cpu_s": cpu,
            }
        )
        print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict[str, float]) -> str:
    return (
        f"record {row['record']:>4} class {row['class']} (iDLG {row['idlg_label']}): "
        f"SSIM {row['ssim']:.3f} PSNR {row['psnr']:.1f} dB | random {row['ssim_random']:.3f}, "
        f"same class {row['ssim_same_class']:.3f} | {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        rows = calibrate(args)
    except (FedltError, ValueError) as exc:  # a grid that does not load, more records than classes
        print(f"error: {exc}", file=sys.stderr)
        return 2
    inverting = sum(r["wall_s"] for r in rows)
    print(
        f"median SSIM {statistics.median(r['ssim'] for r in rows):.3f} "
        f"(random {statistics.median(r['ssim_random'] for r in rows):.3f}, "
        f"same class {statistics.median(r['ssim_same_class'] for r in rows):.3f}), "
        f"median PSNR {statistics.median(r['psnr'] for r in rows):.1f} dB, "
        f"labels {sum(r['idlg_label'] == r['class'] for r in rows)}/{len(rows)} | "
        f"{args.iterations} iterations x {args.restarts} restart(s), TV {args.tv_weight:g}, "
        f"{args.threads} thread(s): inversions {inverting:.1f} s wall "
        f"({inverting / len(rows):.1f} s a record), "
        f"whole run {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
