"""Streaming throughput of the consortium's wire path, and a consortium round against a simulator round.

    python benchmarks/transport.py streaming [--mb 100] [--repeats 5]
    python benchmarks/transport.py rounds [--rounds 8] [--silos 1] [--silo-threads 0] [--repeats 5]

`streaming` serves the real `ConsortiumServicer.FetchState` and `Submit` handlers (1 MiB chunks, mutual TLS
with consortium certificates, identity read from the client certificate) on 127.0.0.1, backed by a stand-in
engine that hands out / accepts an N MB payload, and times download and upload (median of repeats).

`rounds` runs the same settings (FedAvg, LT MNIST-5k, IF 100, α 0.5, McMahan CNN, plaintext layer) in the
simulator and as a real consortium (aggregator + silo processes over mutual TLS), `--repeats` pairs of runs in
alternating order (simulator first, then consortium first, ...), and compares the median wall time per round
(consortium: between consecutive commits, from the database) within each pair. The aggregator evaluates with
the simulator's torch threads, as the simulator does on the same critical path.

The training in a round is the same work on both sides (the weights come out identical) but its time drifts
by a quarter from round to round on a shared machine, more than the consortium's own cost. So each pair also
gives the ratio at equal training: both sides' median time outside training (simulator: its round's
`train_seconds`; consortium: the silo's logged training time) added to the simulator's median training time.
Reported: the median and range over pairs of both ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Round:
    seconds: float
    trained: float  # of which training (the same work on both sides)

    @property
    def other(self) -> float:
        return self.seconds - self.trained


def simulated_rounds(n_rounds: int, silos: int, directory: Path) -> tuple[list[Round], object]:
    """Each round after the first (round time, training time), and the simulator's final state."""
    from dataclasses import replace

    from aggregator.demo import DEMO_PLAN, RECIPE
    from fedlt.sim.config import ModelChoice, SimConfig
    from fedlt.sim.run import run_simulation

    recipe = replace(RECIPE, silos=silos)
    sim = SimConfig(seed=0, rounds=n_rounds, data=recipe, model=ModelChoice("cnn"), train=DEMO_PLAN.train)
    finished: list[tuple[float, float]] = []
    result = run_simulation(
        sim,
        directory,
        echo=lambda _: None,
        on_round=lambda _r, _n, entry: finished.append((time.monotonic(), entry["train_seconds"])),
    )
    return [Round(b - a, trained) for (a, _), (b, trained) in itertools.pairwise(finished)], result.state


TRAINED = re.compile(r"round (\d+): trained on \d+ samples in ([\d.]+) s")


def consortium_rounds(
    n_rounds: int, silos: int, silo_threads: int, directory: Path
) -> tuple[list[Round], object]:
    """Each round after the second (between commits; the first round's time includes start-up) with the
    slowest silo's training time from its log, and the consortium's final state."""
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
    trained: dict[int, float] = {}
    for k in range(silos):
        for r, seconds in TRAINED.findall((directory / f"silo-{k}.log").read_text()):
            trained[int(r)] = max(trained.get(int(r), 0.0), float(seconds))
    rounds = [
        Round((b - a) / 1000, trained[r])
        for r, (a, b) in enumerate(itertools.pairwise(committed[1:]), start=2)
    ]
    return rounds, consortium.final_state()


def compare(sim: list[Round], consortium: list[Round]) -> dict:
    """Round times per side, and the ratio at equal training: the training is the same work on both sides
    (the weights come out identical), yet its time drifts by a quarter from round to round on this kind of
    machine, so the consortium's own cost is what each side spends outside training, set against the
    simulator's training time of the same pair."""
    median = lambda rounds, f: statistics.median(f(r) for r in rounds)  # noqa: E731
    sim_s, consortium_s = median(sim, lambda r: r.seconds), median(consortium, lambda r: r.seconds)
    train_s = median(sim, lambda r: r.trained)
    sim_other, consortium_other = median(sim, lambda r: r.other), median(consortium, lambda r: r.other)
    return {
        "sim_s": sim_s,
        "consortium_s": consortium_s,
        "ratio": consortium_s / sim_s,
        "sim_train_s": train_s,
        "consortium_train_s": median(consortium, lambda r: r.trained),
        "sim_other_s": sim_other,
        "consortium_other_s": consortium_other,
        "ratio_at_equal_training": (train_s + consortium_other) / (train_s + sim_other),
    }


def rounds(n_rounds: int, silos: int, silo_threads: int, repeats: int) -> dict:
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            runs = {
                "sim": lambda r=repeat: simulated_rounds(n_rounds, silos, Path(tmp) / f"sim-{r}"),
                "consortium": lambda r=repeat: consortium_rounds(
                    n_rounds, silos, silo_threads, Path(tmp) / f"consortium-{r}"
                ),
            }
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            done = {name: runs[name]() for name in order}
            (sim, sim_state), (consortium, final) = done["sim"], done["consortium"]
            difference = max(
                float((final.model[k].double() - sim_state.model[k].double()).abs().max())
                for k in final.model
            )
            pair = {**compare(sim, consortium), "max_abs_weight_difference": difference}
            pairs.append(pair)
            print(
                f"pair {repeat + 1}/{repeats}: {pair['ratio']:.3f}, at equal training "
                f"{pair['ratio_at_equal_training']:.3f}",
                file=sys.stderr,
            )
    summary = {}
    for key in ("ratio", "ratio_at_equal_training"):
        values = [p[key] for p in pairs]
        summary[key] = {
            "median": round(statistics.median(values), 3),
            "range": [round(min(values), 3), round(max(values), 3)],
        }
    return {
        "machine": machine(),
        "silos": silos,
        "rounds": n_rounds,
        "repeats": repeats,
        **summary,
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
