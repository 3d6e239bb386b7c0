"""fedlt on a GPU against the CPU: does the GPU path run, how much faster is it, how far do its numbers drift.

    bash benchmarks/device_check.sh [--device cuda] [--rounds 5] [--json PATH]

Without a GPU (or a CUDA build of torch) it prints one line and exits 0. Otherwise, in this one process:
- **a simulator study**: `configs/demo.toml` (FedAvg on LT MNIST-5k, IF 100, α 0.5, 10 silos, the demo's local
  training) for `--rounds` rounds with `[train] device` the GPU, twice as torch runs by default and twice
  under `torch.use_deterministic_algorithms(True, warn_only=True)` (an op with no deterministic
  implementation is listed rather than stopping the run), then once on the CPU. For each: the rounds' seconds
  (local training, sums, server steps, evaluation; after a warm-up of the GPU), the final accuracy, and
  whether a pair gave the same state digest (repeatable on one GPU) — and whether the GPU's state is the
  CPU's (not expected: other kernels, other orders of summation);
- **one DP-SGD epoch** (σ = 1, C = 1, Poisson batches of expected size 32, lr 0.2, momentum 0.9) of the
  McMahan CNN over MNIST-5k's 4,000 training images, on the GPU and on the CPU, from the same weights with
  the same batches and noise (a seeded stream: a benchmark's, never a silo's): seconds and test accuracy.
Both print the accuracy difference GPU − CPU in points. The device runs under CUBLAS_WORKSPACE_CONFIG=:4096:8
(device_check.sh sets it before cuBLAS starts), which deterministic cuBLAS needs. `--json` also writes the
numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.device import CPU, placed, resolve_device
from fedlt.dp import DPSettings
from fedlt.errors import FedltError
from fedlt.methods import ModelSpec
from fedlt.methods.local import train_local
from fedlt.metrics import predict
from fedlt.seeding import torch_generator
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import run_simulation
from privacy.dp import Budget, PrivacyLedger, SiloPrivacy
from privacy.dp.noise import SecureRandom

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo.toml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help='the device to check against the CPU: "cuda" or "cuda:N"')
    p.add_argument("--rounds", type=int, default=5, help="rounds of the simulator study")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    return p.parse_args(argv)


def study(device: str, rounds: int, *, deterministic: bool = False) -> dict:
    """One run of the demo study on `device`: seconds, accuracy per round and the final state's digest."""
    config = load_sim_config(str(CONFIG), {"rounds": rounds}, tables={"train": {"device": device}})
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_simulation(config, Path(out), echo=lambda _: None)
    torch.use_deterministic_algorithms(False)
    rounds_run = result.metrics["rounds"]
    return {
        "device": device,
        "deterministic": deterministic,
        "seconds": round(sum(r["seconds"] for r in rounds_run), 2),  # the rounds', not loading the data
        "train_seconds": round(sum(r["train_seconds"] for r in rounds_run), 2),
        "accuracy": [r["accuracy"] for r in rounds_run],
        "digest": result.state.digest(),
        "nondeterministic_ops": sorted({str(w.message).split("\n")[0] for w in caught if _nondeterminism(w)}),
    }


def _nondeterminism(caught: warnings.WarningMessage) -> bool:
    return "does not have a deterministic implementation" in str(caught.message)


class _Plan:
    """What SiloPrivacy asks of a method: a one-round plan with no statistics releases."""

    rounds = 1

    @staticmethod
    def statistics_plan() -> tuple[tuple, int]:
        return (), 0


def dp_epoch(device: torch.device) -> dict:
    """One DP-SGD epoch over MNIST-5k's training split on `device`: seconds and test accuracy."""
    train, test = split_balanced_test(load_embedded("mnist5k"), per_class=100, seed=0)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    settings = replace(load_sim_config(str(CONFIG), {}).train, local_epochs=1, lr=0.2)
    dp = DPSettings(enabled=True, epsilon=1e6, noise_multiplier=1.0)
    ledger = PrivacyLedger(Budget(dp.epsilon, dp.delta))
    private = SiloPrivacy(dp, method=_Plan(), ledger=ledger, rng=SecureRandom.seeded("device-check"))
    model = ModelSpec("cnn", train.input_shape, train.num_classes, private=True).build(0)
    with placed(model, device):
        _sync(device)
        started = time.perf_counter()
        train_local(model, x, y, settings, torch_generator(0, "device-check"), private=private)
        _sync(device)
        seconds = time.perf_counter() - started
        predicted = predict(model, test.x, device=device)
    return {
        "device": str(device),
        "records": len(y),
        "seconds": round(seconds, 2),
        "accuracy": float(np.mean(predicted == test.y)),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(device: torch.device) -> None:
    """CUDA's context, cuBLAS and cuDNN start on first use (seconds): before any timed run, not in it."""
    model = ModelSpec("cnn", (1, 28, 28), 10).build(0)
    with placed(model, device):
        model(torch.zeros(32, 1, 28, 28, device=device)).sum().backward()
        _sync(device)


def points(a: float, b: float) -> str:
    return f"{100 * (a - b):+.2f} points"


def report(machine: dict, runs: list[dict], cpu: dict, dp: list[dict]) -> str:
    device = runs[0]["device"]
    lines = [
        f"device_check: {machine['gpu']} ({device}), torch {machine['torch']}, CUDA {machine['cuda']}, "
        f"cuDNN {machine['cudnn']} (TF32 convolutions {machine['cudnn_allow_tf32']}, matmuls "
        f"{machine['matmul_allow_tf32']}); CPU: {machine['cpu']}",
        f"simulator study: configs/demo.toml (FedAvg, LT MNIST-5k, 10 silos), {len(cpu['accuracy'])} rounds",
    ]
    for run in [*runs, cpu]:
        mode = "deterministic" if run["deterministic"] else "default"
        lines.append(
            f"  {run['device']:<7} {mode:<13} {run['seconds']:6.2f} s (training {run['train_seconds']:.2f} s)"
            f"  accuracy {100 * run['accuracy'][-1]:.2f} %  state {run['digest'][:12]}"
        )
    for mode in (False, True):
        pair = [r for r in runs if r["deterministic"] is mode]
        same = pair[0]["digest"] == pair[1]["digest"]
        name = "deterministic" if mode else "default"
        lines.append(f"  {device} {name}: the two runs' states are {'the same' if same else 'DIFFERENT'}")
    ops = sorted({op for run in runs for op in run["nondeterministic_ops"]})
    if ops:
        lines.append(f"  ops without a deterministic implementation: {'; '.join(ops)}")
    final = runs[0]["accuracy"][-1]
    drift = max(abs(a - b) for a, b in zip(runs[0]["accuracy"], cpu["accuracy"], strict=True))
    lines.append(
        f"  accuracy {device} − cpu: {points(final, cpu['accuracy'][-1])} (largest over the rounds "
        f"{100 * drift:.2f}); same state as the CPU: {'yes' if runs[0]['digest'] == cpu['digest'] else 'no'}"
    )
    lines.append(f"  time cpu / {device}: {cpu['seconds'] / runs[0]['seconds']:.2f}")
    gpu, host = dp
    lines += [
        f"DP-SGD: one epoch over {gpu['records']} records (σ 1, C 1, expected batch 32)",
        f"  {gpu['device']:<7} {gpu['seconds']:6.2f} s  accuracy {100 * gpu['accuracy']:.2f} %",
        f"  {host['device']:<7} {host['seconds']:6.2f} s  accuracy {100 * host['accuracy']:.2f} %",
        f"  accuracy {gpu['device']} − cpu: {points(gpu['accuracy'], host['accuracy'])}; "
        f"time cpu / {gpu['device']}: {host['seconds'] / gpu['seconds']:.2f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "the CPU build"
        print(f"device_check: no GPU here (torch {torch.__version__}, {build}); nothing to compare, skipped")
        return 0
    try:
        device = resolve_device(args.device, setting="--device")
    except FedltError as exc:
        print(f"device_check: {exc}", file=sys.stderr)
        return 2
    if device.type != "cuda":
        print(f"device_check: --device must name a GPU, got {args.device!r}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    warm_up(device)
    name = str(device)
    runs = [study(name, args.rounds, deterministic=mode) for mode in (False, False, True, True)]
    cpu = study("cpu", args.rounds)
    dp = [dp_epoch(device), dp_epoch(CPU)]
    machine = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        # TF32 (10-bit mantissa) where these are true: a source of GPU-CPU differences on its own
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }
    print(report(machine, runs, cpu, dp))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "study": [*runs, cpu], "dp_sgd": dp}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
