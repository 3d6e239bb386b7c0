"""Streaming throughput of the consortium's wire path, and a consortium round against a simulator round.

    python benchmarks/transport.py streaming [--mb 100] [--repeats 5]
    python benchmarks/transport.py rounds [--rounds 8] [--silos 1] [--silo-threads 0] [--repeats 5]

`streaming` serves the real `ConsortiumServicer.FetchState` and `Submit` handlers (1 MiB chunks, mutual TLS
with consortium certificates, identity read from the client certificate) on 127.0.0.1, backed by a stand-in
engine that hands out / accepts an N MB payload, and times download and upload (median of repeats).

`rounds` runs the same settings (FedAvg, LT MNIST-5k, IF 100, α 0.5, McMahan CNN, plaintext layer) in the
simulator and as a real consortium (aggregator + silo processes over mutual TLS), `--repeats` pairs of runs in
alternating order (simulator first, then consortium first, ...), and compares the median wall time per round
(consortium: between consecutive commits, from the database) within each pair. The machine drifts between
runs, so what is reported is the median of the pairs' ratios with their range. The aggregator evaluates with
the simulator's torch threads, as the simulator does on the same critical path.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.consortium_harness

from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import submit_stream
from tests.consortium_harness import payload_server


def machine() -> str:
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {python}, grpcio {grpc.__version__}"


def streaming(mb: int, repeats: int) -> dict:
    payload = os.urandom(mb * 2**20)
    down, up = [], []
    with tempfile.TemporaryDirectory() as tmp, payload_server(Path(tmp), payload) as stub:
        for _ in range(repeats + 1):
            started = time.perf_counter()
            data = b"".join(p.data for p in stub.FetchState(pb.FetchStateRequest(round_id="r")))
            down.append(time.perf_counter() - started)
            assert data == payload
            started = time.perf_counter()
            receipt = stub.Submit(
                submit_stream("r", payload, kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose="contribution")
            )
            up.append(time.perf_counter() - started)
            assert receipt.sha256 == hashlib.sha256(payload).hexdigest()
    down, up = down[1:], up[1:]  # the first pair warms up the connection
    return {
        "machine": machine(),
        "payload_mb": mb,
        "repeats": repeats,
        "download_mb_per_s": round(mb / statistics.median(down), 1),
        "upload_mb_per_s": round(mb / statistics.median(up), 1),
        "download_s_median": round(statistics.median(down), 3),
        "upload_s_median": round(statistics.median(up), 3),
    }


def simulated_round_s(n_rounds: int, silos: int, directory: Path) -> tuple[float, object]:
    """Median seconds between the simulator's rounds, and its final state."""
    from dataclasses import replace

    from aggregator.demo import DEMO_PLAN, RECIPE
    from fedlt.sim.config import ModelChoice, SimConfig
    from fedlt.sim.run import run_simulation

    recipe = replace(RECIPE, silos=silos)
    sim = SimConfig(seed=0, rounds=n_rounds, data=recipe, model=ModelChoice("cnn"), train=DEMO_PLAN.train)
    finished: list[float] = []
    result = run_simulation(
        sim, directory, echo=lambda _: None, on_round=lambda *_: finished.append(time.monotonic())
    )
    return statistics.median(b - a for a, b in itertools.pairwise(finished)), result.state


def consortium_round_s(n_rounds: int, silos: int, silo_threads: int, directory: Path) -> tuple[float, object]:
    """Median seconds between a consortium's commits after its first (whose time includes start-up), and
    its final state."""
    from dataclasses import replace

    from aggregator.config import ConsortiumSection, TimeoutSection
    from aggregator.demo import DEMO_PLAN, RECIPE, write_consortium
    from tests.consortium_harness import Consortium

    _, configs = write_consortium(
        directory,
        recipe=replace(RECIPE, silos=silos),
        plan=DEMO_PLAN,
        consortium=ConsortiumSection(id="bench", rounds=n_rounds, min_silos=silos, privacy="plaintext"),
        timeouts=TimeoutSection(gather=5.0, round=300.0),
        silo_threads=silo_threads,
    )
    consortium = Consortium(directory, configs, aggregator_threads=torch.get_num_threads())
    try:
        consortium.start()
        consortium.wait_aggregator(timeout=60 * n_rounds)
    finally:
        consortium.stop()
    store = consortium.store()
    committed = [ms for (ms,) in store._db.execute("SELECT committed_ms FROM states ORDER BY round")]
    store.close()
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(committed[1:])]
    return statistics.median(gaps), consortium.final_state()


def rounds(n_rounds: int, silos: int, silo_threads: int, repeats: int) -> dict:
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            runs = {
                "sim": lambda r=repeat: simulated_round_s(n_rounds, silos, Path(tmp) / f"sim-{r}"),
                "consortium": lambda r=repeat: consortium_round_s(
                    n_rounds, silos, silo_threads, Path(tmp) / f"consortium-{r}"
                ),
            }
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            done = {name: runs[name]() for name in order}
            (sim_s, sim_state), (consortium_s, final) = done["sim"], done["consortium"]
            difference = max(
                float((final.model[k].double() - sim_state.model[k].double()).abs().max())
                for k in final.model
            )
            pairs.append(
                {"sim_s": sim_s, "consortium_s": consortium_s, "max_abs_weight_difference": difference}
            )
            print(f"pair {repeat + 1}/{repeats}: {consortium_s / sim_s:.3f}", file=sys.stderr)
    ratios = [p["consortium_s"] / p["sim_s"] for p in pairs]
    return {
        "machine": machine(),
        "silos": silos,
        "rounds": n_rounds,
        "repeats": repeats,
        "ratio_consortium_over_sim_median": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "pairs": [
            {k: round(v, 4) if k != "max_abs_weight_difference" else v for k, v in p.items()} for p in pairs
        ],
        "silo_threads": silo_threads or torch.get_num_threads(),
        "sim_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("streaming")
    s.add_argument("--mb", type=int, default=100)
    s.add_argument("--repeats", type=int, default=5)
    r = commands.add_parser("rounds")
    r.add_argument("--rounds", type=int, default=8)
    r.add_argument("--silos", type=int, default=1)
    r.add_argument("--silo-threads", type=int, default=0, help="torch threads per silo; 0 = all cores")
    r.add_argument("--repeats", type=int, default=5, help="pairs of runs, in alternating order")
    args = parser.parse_args()
    result = (
        streaming(args.mb, args.repeats)
        if args.command == "streaming"
        else rounds(args.rounds, args.silos, args.silo_threads, args.repeats)
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
