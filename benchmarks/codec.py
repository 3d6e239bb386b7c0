"""The fixed-point codec's encode at ResNet-8's size, rounding to nearest against rounding stochastically.

    python benchmarks/codec.py [--repeats 21] [--values 1229131] [--seed 0] [--parts]

Issue 37 asks for the stochastic encode within 1.5× the deterministic one. The vector is shaped like FedAvg's
ResNet-8 contribution: a model change of --values − 1 numbers (bound 10, 24 fractional bits) and the sample
count n, 1,229,131 float64 values (9.8 MB) by default; the change is Gaussian with standard deviation 10⁻³
(the values set no cost). The deterministic codec is the one for 10 silos, where the change fits 32-bit words
at its own 24 bits; the stochastic one is for 30 silos, where it travels in 32-bit words at 22 bits, rounded
stochastically with uniforms keyed by the vector (`privacy.ring`). Every repeat draws a fresh vector, as every
round has one, and encodes it with both codecs, the one going first alternating between repeats. The script
prints the medians over the repeats, their ratio, the range of the per-repeat ratios, the machine and its
load averages (a busy machine widens the range; compare medians from one run). With --parts each repeat also
times, on the same vector, what only the stochastic encode does: its rounding key and its 16-bit uniforms
(`SecureRandom.words`), beside the finiteness check both encodes make.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import cryptography
import numpy as np
import torch
from cryptography.hazmat.backends.openssl.backend import backend as openssl

from fedlt.aggregation import Field, Schema
from privacy.dp.noise import SecureRandom
from privacy.ring import FixedPointCodec, rounding_key

DETERMINISTIC_SILOS, STOCHASTIC_SILOS = 10, 30


def schema_of(values: int) -> Schema:
    """FedAvg's contribution for a model of values − 1 parameters (`benchmarks/secagg.py` builds the real one
    from the method; only the sizes, bounds and precisions matter here)."""
    return Schema((Field("delta", (values - 1,), 10.0, frac_bits=24), Field("n", (), 1e4, frac_bits=0)))


def vector(values: int, rng: np.random.Generator) -> torch.Tensor:
    change = rng.standard_normal(values - 1) * 1e-3
    return torch.from_numpy(np.append(change, 500.0))


def timed(action: Callable[[Any], object], argument: Any) -> float:
    start = time.perf_counter()
    action(argument)
    return time.perf_counter() - start


PARTS: dict[str, Callable[[np.ndarray], object]] = {
    "rounding key": rounding_key,
    "16-bit uniforms": lambda x: SecureRandom(bytes(32)).words((len(x) + 3) // 4),
    "finiteness check": lambda x: np.isfinite(x).all(),
}


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy "
        f"{np.__version__}, torch {torch.__version__}, cryptography {cryptography.__version__} "
        f"({openssl.openssl_version_text()}), load averages {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=21, help="vectors encoded by both codecs (15 or more for the issue)"
    )
    parser.add_argument("--values", type=int, default=1_229_131, help="the vector's length, n included")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", action="store_true", help="also time the stochastic encode's own parts")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.values < 2:
        parser.error("need --repeats >= 1 and --values >= 2")
    schema = schema_of(args.values)
    codecs = {
        "deterministic": FixedPointCodec(schema, max_silos=DETERMINISTIC_SILOS),
        "stochastic": FixedPointCodec(schema, max_silos=STOCHASTIC_SILOS),
    }
    assert [e.stochastic for e in codecs["stochastic"].encodings] == [True, False]
    assert not any(e.stochastic for e in codecs["deterministic"].encodings)
    rng = np.random.default_rng(args.seed)
    parts = PARTS if args.parts else {}
    seconds: dict[str, list[float]] = {name: [] for name in [*codecs, *parts]}
    for repeat in range(args.repeats):
        x = vector(args.values, rng)
        order = list(codecs) if repeat % 2 == 0 else list(reversed(codecs))
        for name in order:
            seconds[name].append(timed(codecs[name].encode, x))
        for name, part in parts.items():
            seconds[name].append(timed(part, x.numpy()))
    medians = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
    ratios = [s / d for s, d in zip(seconds["stochastic"], seconds["deterministic"], strict=True)]
    print(f"encode of {args.values:,} values, medians of {args.repeats} alternating repeats; {machine()}")
    for name, codec in codecs.items():
        words = codec.encodings[0]
        print(f"  {name:16s} {medians[name]:7.3f} ms  ({words.bits}-bit words at f = {words.frac_bits})")
    print(
        f"  ratio {medians['stochastic'] / medians['deterministic']:.2f} "
        f"(per repeat {min(ratios):.2f}–{max(ratios):.2f}; target <= 1.5)"
    )
    for name in parts:
        print(f"  {name:16s} {medians[name]:7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
