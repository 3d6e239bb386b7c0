"""Streaming throughput of the consortium's wire path, and a consortium round against a simulator round.

    python benchmarks/transport.py streaming [--mb 100] [--repeats 5]
    python benchmarks/transport.py rounds [--rounds 8] [--silos 1] [--silo-threads 0]

`streaming` serves the real `ConsortiumServicer.FetchState` and `Submit` handlers (1 MiB chunks, mutual TLS
with consortium certificates, identity read from the client certificate) on 127.0.0.1, backed by a stand-in
engine that hands out / accepts an N MB payload, and times download and upload (median of repeats).

`rounds` runs the same settings (FedAvg, LT MNIST-5k, IF 100, α 0.5, McMahan CNN, plaintext layer) twice in
this run: in the simulator, and as a real consortium (aggregator + silo processes over mutual TLS), and
compares the median wall time per round (consortium: between consecutive commits, from the database).
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


def rounds(n_rounds: int, silos: int, silo_threads: int) -> dict:
    from dataclasses import replace

    from aggregator.config import ConsortiumSection, TimeoutSection
    from aggregator.demo import DEMO_PLAN, RECIPE
    from fedlt.sim.config import ModelChoice, SimConfig
    from fedlt.sim.run import run_simulation
    from tests.consortium_harness import Consortium

    recipe = replace(RECIPE, silos=silos)
    with tempfile.TemporaryDirectory() as tmp:
        sim = SimConfig(seed=0, rounds=n_rounds, data=recipe, model=ModelChoice("cnn"), train=DEMO_PLAN.train)
        finished: list[float] = []
        result = run_simulation(
            sim, Path(tmp) / "sim", echo=lambda _: None, on_round=lambda *_: finished.append(time.monotonic())
        )
        sim_gaps = [b - a for a, b in itertools.pairwise(finished)]
        from aggregator.demo import write_consortium

        directory = Path(tmp) / "consortium"
        _, configs = write_consortium(
            directory,
            recipe=recipe,
            plan=DEMO_PLAN,
            consortium=ConsortiumSection(id="bench", rounds=n_rounds, min_silos=silos, privacy="plaintext"),
            timeouts=TimeoutSection(gather=5.0, round=300.0),
            silo_threads=silo_threads,
        )
        consortium = Consortium(directory, configs)
        try:
            consortium.start()
            consortium.wait_aggregator(timeout=60 * n_rounds)
        finally:
            consortium.stop()
        store = consortium.store()
        committed = [ms for (ms,) in store._db.execute("SELECT committed_ms FROM states ORDER BY round")]
        store.close()
        final = consortium.final_state()
    # gaps between consecutive commits after the first round, whose time includes start-up
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(committed[1:])]
    difference = max(
        float((final.model[k].double() - result.state.model[k].double()).abs().max()) for k in final.model
    )
    return {
        "machine": machine(),
        "silos": silos,
        "rounds": n_rounds,
        "sim_round_s_median": round(statistics.median(sim_gaps), 3),
        "consortium_round_s_median": round(statistics.median(gaps), 3),
        "ratio_consortium_over_sim": round(statistics.median(gaps) / statistics.median(sim_gaps), 3),
        "silo_threads": silo_threads or torch.get_num_threads(),
        "sim_threads": torch.get_num_threads(),
        "max_abs_weight_difference": difference,
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
    args = parser.parse_args()
    result = (
        streaming(args.mb, args.repeats)
        if args.command == "streaming"
        else rounds(args.rounds, args.silos, args.silo_threads)
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
