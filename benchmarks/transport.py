"""Streaming throughput of the consortium's wire path, and a consortium round against a simulator round.

    python benchmarks/transport.py streaming [--mb 100] [--repeats 5]
    python benchmarks/transport.py rounds [--rounds 8] [--silos 4]

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
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.service import ConsortiumServicer, Identity
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc
from privacy.pki.ca import init_ca, issue_server, issue_silo
from privacy.pki.identity import RevocationList


class PayloadEngine:
    """Serves one payload and accepts uploads of the same size, as the round engine would."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.config = SimpleNamespace(consortium=SimpleNamespace(id="bench", privacy="plaintext"))

    def state_for(self, silo_id: str, round_id: str) -> bytes:
        return self.payload

    def expected_bytes(self, silo_id: str, round_id: str) -> int:
        return len(self.payload)

    def submit(self, silo_id: str, round_id: str, payload: bytes) -> str:
        return hashlib.sha256(payload).hexdigest()


def machine() -> str:
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {python}, grpcio {grpc.__version__}"


def streaming(mb: int, repeats: int) -> dict:
    from silo.agent import _submit_stream

    payload = os.urandom(mb * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        pki = Path(tmp)
        init_ca(pki / "ca", name="bench CA")
        issue_server(pki / "ca", pki, hosts=["127.0.0.1"])
        issue_silo(pki / "ca", pki, silo_id="silo-0")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        identity = Identity(RevocationList.load(pki / "ca" / "ca.pem", pki / "ca" / "crl.pem"))
        servicer = ConsortiumServicer(PayloadEngine(payload), None, identity, b"")
        consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server(servicer, server)
        creds = grpc.ssl_server_credentials(
            [((pki / "aggregator.key").read_bytes(), (pki / "aggregator.pem").read_bytes())],
            root_certificates=(pki / "ca" / "ca.pem").read_bytes(),
            require_client_auth=True,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        client = grpc.ssl_channel_credentials(
            root_certificates=(pki / "ca" / "ca.pem").read_bytes(),
            private_key=(pki / "silo-0.key").read_bytes(),
            certificate_chain=(pki / "silo-0.pem").read_bytes(),
        )
        down, up = [], []
        try:
            with grpc.secure_channel(f"127.0.0.1:{port}", client) as channel:
                stub = consortium_pb2_grpc.ConsortiumServiceStub(channel)
                for _ in range(repeats + 1):
                    started = time.perf_counter()
                    data = b"".join(p.data for p in stub.FetchState(pb.FetchStateRequest(round_id="r")))
                    down.append(time.perf_counter() - started)
                    assert data == payload
                    started = time.perf_counter()
                    receipt = stub.Submit(_submit_stream("r", payload))
                    up.append(time.perf_counter() - started)
                    assert receipt.sha256 == hashlib.sha256(payload).hexdigest()
        finally:
            server.stop(0)
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


def rounds(n_rounds: int, silos: int) -> dict:
    from dataclasses import replace

    from aggregator.config import ConsortiumSection, TimeoutSection
    from aggregator.demo import DEMO_PLAN, RECIPE
    from fedlt.sim.config import ModelChoice, SimConfig
    from fedlt.sim.run import run_simulation
    from tests.consortium_harness import Consortium

    recipe = replace(RECIPE, silos=silos)
    with tempfile.TemporaryDirectory() as tmp:
        sim = SimConfig(seed=0, rounds=n_rounds, data=recipe, model=ModelChoice("cnn"), train=DEMO_PLAN.train)
        result = run_simulation(sim, Path(tmp) / "sim", echo=lambda _: None)
        sim_seconds = [r["seconds"] for r in result.metrics["rounds"]]
        from aggregator.demo import write_consortium

        directory = Path(tmp) / "consortium"
        _, configs = write_consortium(
            directory,
            recipe=recipe,
            plan=DEMO_PLAN,
            consortium=ConsortiumSection(id="bench", rounds=n_rounds, min_silos=silos),
            timeouts=TimeoutSection(gather=5.0, round=300.0),
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
    same = all(
        torch.allclose(final.model[k].double(), result.state.model[k].double(), atol=1e-5)
        for k in final.model
    )
    return {
        "machine": machine(),
        "silos": silos,
        "rounds": n_rounds,
        "sim_round_s_median": round(statistics.median(sim_seconds[1:]), 3),
        "consortium_round_s_median": round(statistics.median(gaps), 3),
        "ratio_consortium_over_sim": round(statistics.median(gaps) / statistics.median(sim_seconds[1:]), 3),
        "same_model_as_sim": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("streaming")
    s.add_argument("--mb", type=int, default=100)
    s.add_argument("--repeats", type=int, default=5)
    r = commands.add_parser("rounds")
    r.add_argument("--rounds", type=int, default=8)
    r.add_argument("--silos", type=int, default=4)
    args = parser.parse_args()
    result = (
        streaming(args.mb, args.repeats) if args.command == "streaming" else rounds(args.rounds, args.silos)
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
