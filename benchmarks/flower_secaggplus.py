"""Flower SecAgg+'s masked-input stage for one client, timed with Flower's own code (benchmarks/secagg.py).

Runs in an environment of its own with `flwr` installed, never the project's (flwr is no dependency of
fedlt):

    python3 -m venv .flwr && .flwr/bin/pip install flwr==1.42.0
    .flwr/bin/python benchmarks/flower_secaggplus.py --silos 10 --shapes '[[1229131]]' --repeats 1

It plays stages 0 and 1 of Flower's client mod (`_setup`, `_share_keys`) for every client of a full graph
(Flower's default `num_shares` is 100, so every client holds shares of every other below 100 clients), then
times client 0's stage 2, `_collect_masked_vectors`: opening the other clients' share ciphertexts, weighting
and quantizing the float32 parameters (clip 8.0, 2^22 levels, mod 2^32: the workflow's defaults), the
private mask and a pairwise mask (with its key agreement) per peer. It prints one JSON object: the seconds
of each repeat and the flwr version.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time

import flwr
import numpy as np
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import Key

mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the package re-exports a
# function under the module's name

DEFAULTS = {  # SecAggPlusWorkflow's defaults
    Key.CLIPPING_RANGE: 8.0,
    Key.TARGET_RANGE: 2**22,
    Key.MOD_RANGE: 2**32,
    Key.MAX_WEIGHT: 1000.0,
}


def masked_input_seconds(silos: int, shapes: list[list[int]], seed: int) -> float:
    configs = DEFAULTS | {
        Key.SAMPLE_NUMBER: silos,
        Key.SHARE_NUMBER: silos,
        Key.THRESHOLD: math.floor(2 * silos / 3) + 1,
    }
    states = {nid: mod.SecAggPlusState(nid=nid) for nid in range(silos)}
    keys = {str(nid): tuple(mod._setup(state, configs).values()) for nid, state in states.items()}
    shared = {nid: mod._share_keys(state, keys) for nid, state in states.items()}
    to_first = [
        (nid, out[Key.CIPHERTEXT_LIST][out[Key.DESTINATION_LIST].index(0)])
        for nid, out in shared.items()
        if nid != 0
    ]
    rng = np.random.default_rng(seed)
    parameters = ndarrays_to_parameters(
        [rng.standard_normal(shape).astype(np.float32) * 1e-3 for shape in shapes]
    )
    stage = {Key.SOURCE_LIST: [nid for nid, _ in to_first], Key.CIPHERTEXT_LIST: [c for _, c in to_first]}
    started = time.perf_counter()
    mod._collect_masked_vectors(states[0], stage, 100, parameters)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, required=True)
    parser.add_argument("--shapes", required=True, help="JSON list of the parameter arrays' shapes")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    shapes = json.loads(args.shapes)
    seconds = [masked_input_seconds(args.silos, shapes, seed) for seed in range(args.repeats)]
    print(json.dumps({"flwr": flwr.__version__, "seconds": seconds}))


if __name__ == "__main__":
    main()
