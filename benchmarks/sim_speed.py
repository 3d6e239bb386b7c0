"""Local-training throughput of the simulator against a bare PyTorch loop on the same data and model.

    python benchmarks/sim_speed.py [--repeats 7] [--epochs 1] [--dataset mnist5k] [--model cnn]

Both sides train the same model from the same initial weights on the same samples (an embedded dataset's
training images after the balanced hold-out of 100 test images per class: 4,000 for MNIST-5k), with the same
batch size, optimizer and batch order. The simulator side is a full `FedAvg.local_round`: loading the global
state, training, forming n·Δw, clipping and checking the contribution. Runs alternate (bare, sim, bare, sim,
...) so drift on a noisy machine hits both; the report gives medians and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from fedlt.data.embedded import EMBEDDED, load_embedded, split_balanced_test
from fedlt.methods import ModelSpec, SiloContext, TrainConfig
from fedlt.methods.fedavg import FedAvg, FedAvgOptions


def bare_loop(model, x, y, config: TrainConfig, generator: torch.Generator) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    model.train()
    for _ in range(config.local_epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), config.batch_size):
            idx = order[start : start + config.batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dataset", default="mnist5k", choices=tuple(EMBEDDED))
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()

    train, _ = split_balanced_test(load_embedded(args.dataset), per_class=100, seed=0)
    config = TrainConfig(local_epochs=args.epochs, batch_size=32, lr=0.05, momentum=0.9)
    spec = ModelSpec(args.model, train.input_shape, train.num_classes)
    method = FedAvg(options=FedAvgOptions(), train=config, model=spec, rounds=1)
    state = method.init_state(seed=0)
    ctx = SiloContext(1, "silo-0", 0)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    bare_model = spec.build(0)
    samples = len(train) * args.epochs

    def time_bare() -> float:
        bare_model.load_state_dict(state.model)
        started = time.perf_counter()
        bare_loop(bare_model, x, y, config, ctx.generator("shuffle"))
        return time.perf_counter() - started

    def time_sim() -> float:
        started = time.perf_counter()
        method.local_round(state, train, ctx)
        return time.perf_counter() - started

    time_bare(), time_sim()  # warm-up: allocator, kernels, first-touch
    bare, sim = [], []
    for _ in range(args.repeats):
        bare.append(time_bare())
        sim.append(time_sim())
    ratios = [s / b for s, b in zip(sim, bare, strict=True)]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "dataset": args.dataset,
        "model": args.model,
        "samples_per_run": samples,
        "repeats": args.repeats,
        "bare_samples_per_s": round(samples / statistics.median(bare)),
        "sim_samples_per_s": round(samples / statistics.median(sim)),
        "median_ratio_sim_over_bare": round(statistics.median(ratios), 4),
        "overhead_percent": round(100 * (statistics.median(ratios) - 1), 2),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
