"""Secure aggregation's costs at ResNet-8 size: masking, unmasking, bytes on the wire, and a whole round.

    python benchmarks/secagg.py session [--silos 3 10 30] [--repeats 5 | R1 R2 ...] [--model resnet8]
        [--graphs full secagg+] [--full-up-to 30] [--flower .flwr/bin/python] [--layers secagg [blind]]
    python benchmarks/secagg.py rounds [--silos 3 10] [--rounds 6] [--pairs 2] [--model resnet8]
        [--layers plaintext secagg [ckks] [blind]] [--budget-minutes 15] [--keep DIR]

(`benchmarks/load.py` runs 3 to 30 silo processes with the full graph and SecAgg+'s, for latency and memory.)

`session` runs whole secure sums in this process, as `privacy.secagg.local` does, with the real clients and
server, consortium certificates as credentials, and every message in its Protobuf form
(`privacy.secagg.wire`).
The vector is the FedAvg contribution of the model on the embedded 1×28×28 data: its float entries and n
(1,229,131 numbers for ResNet-8), in the ring the codec chooses for n silos (32-bit words for the model
change up to 51 silos, `privacy.ring`).
For each n and repeat it measures:
- masking: one silo's `masked_input` (opening its envelopes, X25519 agreements, the self mask and n − 1
  pairwise masks), median over the silos, against `bare`: the same n × ring bytes of the masks' keystream
  (AES-128-CTR) from cryptography's `update_into` into one reused buffer of `keystreams.BLOCK_BYTES`, with no
  arithmetic; ChaCha20's bare keystream on the same seeds too, in the same loop (the choice of cipher);
  also `apply_masks` alone (the n masks, no protocol) and the codec's encode and decode.
- with `--flower PYTHON` (an interpreter of an environment of its own with flwr installed:
  `python3 -m venv .flwr && .flwr/bin/pip install flwr==1.42.0`), Flower SecAgg+ on the same model's
  parameter arrays, right after ours in each repeat (benchmarks/flower_secaggplus.py: Flower's own server
  workflow and client code, every client in one process): a client's masked-input stage (median over
  clients; the ratio is it over our encode + masking) and the server's unmask stage in the same dropout
  cases as ours (the ratio is it over our aggregator's). Flower's `num_shares` is our holders per seed
  (n for the full graph, k + 1 for SecAgg+'s: its neighbourhoods are a shuffled ring of num_shares nodes
  centred on each, itself included), its threshold ours where its workflow takes it (t < num_shares; at
  n = 3, t = 3 of 3, it runs with 2).
- unmasking: the aggregator's `close_unmask` with no dropout, with one silo gone after its masked input (its
  self mask is rebuilt from shares, like everyone's) and with one gone before it (its mask key is rebuilt and
  its pairwise mask with every survivor removed). A silo can be lost only if n − 1 silos still reach the
  threshold t; at n = 3, t = 3, so both dropout cases are skipped there.
- bytes: the serialized Protobuf size of every message one silo sends and receives in the secure sum
  (the aggregator's `SecAggStep`s as they travel, inside a `JoinResponse`), without gRPC, HTTP/2 or TLS
  framing, against the contribution's numbers as float32 (4 bytes each) and the plaintext Submit stream of
  the same contribution. The key list carries every silo's certificate PEM, which peers need to check the
  keys' signatures.
With `--layers secagg blind`, each repeat also runs the same sessions under `blind` (secagg's session with an
output mask under its masks; the two layers in alternating order) and reports it against secagg's: a silo's
masking (its output mask included; one output mask alone too: an HMAC seed and one keystream), the
aggregator's unmasking (which hands the still-masked total to the silos), a silo's reading of that total
(removing the survivors' output masks and decoding), and bytes: the same uploads, and the total each silo
fetches (announced in a SumStep, streamed through FetchSum). What a blind silo also sends each round, outside
the sum, because silos step the model: its sealed next state (a ReportState stream) and its masked evaluation
counts. In every session each party that reads the sum (secagg's aggregator, each blind silo) must read the
fixed-point sum of the survivors' encoded inputs to the bit, or the benchmark stops.
With `--graphs full secagg+` it does all of this for the complete graph and for SecAgg+'s sparse graph of
`secagg_plus_degree(n)` = k neighbours (skipped where that degree would reach n − 1: the graph would be the
complete one), and adds the masking time summed over all n silos: the consortium's pairwise work, O(n²) for
the complete graph and O(n log n) for SecAgg+. A SecAgg+ silo has k + 1 masks, not n, so its `bare` and
`apply_masks` expand k + 1 seeds; a seed's k + 1 holders, not n, decide which dropouts the sum survives.
The complete graph is skipped beyond `--full-up-to` silos (30: its n² masks, with every silo in this one
process, would take the run's time), and so said in the output. `--repeats` takes one count per n, for
fewer repeats where a session is long. Each graph measured at three n or more gets its costs fitted against
n (`fit_growth`: a + b · log n, n, n log n or n², least squares, and the log-log slope): a silo's masking,
all silos' masking, the aggregator's unmasking in each case and the bytes per silo.

`rounds` runs a real consortium (aggregator + n silo processes over mutual TLS on 127.0.0.1, one torch
thread per silo, the demo's recipe and training plan: FedAvg, LT MNIST-5k, IF 100, α 0.5) with each privacy
layer of --layers (default `plaintext` and `secagg`; `ckks` for issue 13, `blind` for issue 33), same settings
and seed, in alternating order (--pairs 2: plaintext, secagg, secagg, plaintext, so a drift of the machine
favours none), and compares the median time between consecutive commits over each layer's runs with the
first layer's (from the database's audit log; each run's first round, which includes start-up, excluded).
It also splits a round by the audit log: attempt start → last contribution accepted (training, and for
secagg the keys, shares and masked-input stages), → commit (for secagg the consistency and unmask stages),
→ next attempt start (evaluation of the committed model on the operator's test set). Where silos step the
model (ckks, blind) the stages differ: → commit also holds the silos fetching the sum and reading it, the
server step on every silo, each silo's evaluation of the new state on its share of the test split, the
evaluation sum and the sealed state reports; → next start is left with the aggregator's bookkeeping alone.
Others' load on a shared machine moves the silos' training most, and training is the same work under every
layer (their models agree), so each round is also reported beyond its slowest silo's local training (from
the silos' logs), with each layer's median of that against the first layer's, in seconds. Each run records
the machine's load averages before and after it. A run that takes longer than --budget-minutes is stopped
and reported as not measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import cryptography
import grpc
import numpy as np
import torch
from cryptography.hazmat.backends.openssl.backend import backend as openssl
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf.message import Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.consortium_harness

from aggregator.config import ConsortiumSection, TimeoutSection
from aggregator.demo import DEMO_PLAN, RECIPE, demo_layer_settings, write_consortium
from aggregator.store import AuditRecord
from fedlt.aggregation import Schema, make_layer
from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    PartyKeys,
    Released,
    Signer,
    SiloSide,
    SumSpec,
    evaluation_schema,
)
from fedlt.aggregation.plaintext import to_wire
from fedlt.aggregation.registry import record as layer_record
from fedlt.data.federation import DataConfig
from fedlt.methods.state import float_keys, pack_state
from fedlt.models import MODELS
from fedlt.plan import ModelSection, RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import chunks, submit_stream
from privacy import ring as keystreams
from privacy.blind.halves import CountsTotal, MaskedCounts
from privacy.blind.keys import OutputKey, add_mask, sum_label
from privacy.peers import ConsortiumPeers
from privacy.pki.ca import init_ca, issue_server, issue_silo
from privacy.pki.identity import MemberTrust, RevokedSerials
from privacy.pki.roster import Roster, draft
from privacy.pki.signing import load_private_key, sign
from privacy.ring import FixedPointCodec, Ring
from privacy.secagg.local import STAGES
from privacy.secagg.protocol import Inbox, KeyList
from privacy.secagg.settings import SecAggSettings
from privacy.stepping.sealed_state import seal_state
from privacy.wire import (
    consortium_layers,
    fetched,
    payload_of,
    received,
    receivers,
    send,
    step_from_pb,
    step_to_pb,
    submitted,
)
from tests.consortium_harness import RECIPE as DIGITS
from tests.consortium_harness import SILO_THREADS, Consortium

SESSION_LAYERS = ("secagg", "blind")  # the layers whose sum is secagg's session
DROPOUTS = {"none": "", "after_masked": "consistency", "before_masked": "masked"}  # first stage not answered


def machine() -> str:
    """transport.py's line, plus what sets ChaCha20's speed (CPU, OpenSSL) and numpy's additions.

    Not imported from transport.py: benchmarks/ is no package, and the venv has an unrelated `benchmarks`.
    """
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo") if line.startswith("model name")),
        "unknown CPU",
    )
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}, cryptography {cryptography.__version__} "
        f"({openssl.openssl_version_text()}), numpy {np.__version__}, torch {torch.__version__}"
    )


def _read(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def loadavg() -> list[float]:
    """The machine's load averages (1, 5, 15 minutes); empty where /proc has none."""
    fields = _read("/proc/loadavg")
    return [float(x) for x in fields[0].split()[:3]] if fields else []


def plan_for(model: str) -> RoundPlan:
    """The demo's plan (FedAvg on 1×28×28 LT MNIST-5k) with another model; a model that takes no 28×28
    images (cnn-small) gets its own side (8×8, scikit-learn's digits)."""
    channels, side, _ = DEMO_PLAN.model.image_shape
    side = side if side in MODELS[model].sides else MODELS[model].sides[0]
    return replace(DEMO_PLAN, model=ModelSection(name=model, image_shape=(channels, side, side)))


def recipe_for(model: str) -> DataConfig:
    """The demo's LT MNIST-5k for a model that takes 28×28 images, the tests' 8×8 digits for cnn-small."""
    return DIGITS if plan_for(model).model.image_shape[-1] == 8 else RECIPE


GRAPHS = ("full", "secagg+")
FULL_UP_TO = 30  # silos: beyond, `session` skips the complete graph unless asked (--full-up-to)


def secagg_plus_degree(n: int) -> int:
    """SecAgg+'s neighbours per silo for n silos: 2⌈log2 n⌉, docs/operator.md's suggestion (Bell et al.,
    CCS 2020: a degree of order log n keeps the protocol secure and correct with high probability). 0, the
    complete graph, where that degree would reach n − 1 and the graph would be complete anyway.

    >>> [secagg_plus_degree(n) for n in (3, 10, 30, 100, 1000)]
    [0, 8, 10, 14, 20]
    """
    k = 2 * math.ceil(math.log2(n)) if n > 1 else 0
    return k if k < n - 1 else 0


def neighbours_for(graph: str, n: int) -> int:
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; allowed: {', '.join(GRAPHS)}")
    return secagg_plus_degree(n) if graph == "secagg+" else 0


def contribution_schema(model: str) -> Schema:
    """What a consortium round sums for `model`: the method's schema at the initial state."""
    method = plan_for(model).build_method()
    return method.schema(method.init_state(seed=0))


def contribution(schema: Schema, seed: int) -> torch.Tensor:
    """A flat float64 contribution well inside the schema's bounds (the values do not change any cost)."""
    generator = torch.Generator().manual_seed(seed)
    values = {
        f.name: torch.randn(f.shape, generator=generator, dtype=torch.float64) * f.bound * 1e-6
        for f in schema.fields
    }
    return schema.contribution(**values).flat()


def median(values: Iterable[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


# --- item 1: keystream floor ---------------------------------------------------------------------------


def bare_keystream(seeds: list[bytes], nbytes: int, keystream: str = keystreams.MASK_KEYSTREAM) -> float:
    """Seconds to expand len(seeds) × nbytes of `keystream` in the blocks `privacy.ring` uses, no arithmetic:
    the floor masking is measured against."""
    zeros = memoryview(bytes(keystreams.BLOCK_BYTES))
    buffer = bytearray(keystreams.BLOCK_BYTES + 64)
    started = time.perf_counter()
    for seed in seeds:
        encryptor = keystreams.stream(seed, keystream)
        for start in range(0, nbytes, keystreams.BLOCK_BYTES):
            encryptor.update_into(zeros[: min(keystreams.BLOCK_BYTES, nbytes - start)], buffer)
    return time.perf_counter() - started


def masks_only(seeds: list[bytes], ring: Ring, vector: np.ndarray) -> float:
    """Seconds for `apply_masks` alone over all the seeds: masking without envelopes or key agreement."""
    target = vector.copy()
    started = time.perf_counter()
    keystreams.apply_masks(ring, target, [(seed, False) for seed in seeds])
    return time.perf_counter() - started


def timed(action: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = action()
    return result, time.perf_counter() - started


# --- items 1–3: one secure sum, message by message -------------------------------------------------------


@dataclass(frozen=True)
class Members:
    """Consortium certificates and roster for the silos: what each signs with, and what its peers check."""

    ca_pem: bytes
    keys: Mapping[str, ec.EllipticCurvePrivateKey]
    certificates: Mapping[str, bytes]
    roster: Roster

    @classmethod
    def issue(cls, directory: Path, silos: int) -> Members:
        init_ca(directory / "ca", name="secagg benchmark CA")
        aggregator = issue_server(directory / "ca", directory, hosts=["127.0.0.1"]).certificate.read_bytes()
        ids = [f"silo-{k}" for k in range(silos)]
        for silo in ids:
            issue_silo(directory / "ca", directory, silo_id=silo)
        certificates = {u: (directory / f"{u}.pem").read_bytes() for u in ids}
        return cls(
            (directory / "ca" / "ca.pem").read_bytes(),
            {u: load_private_key(directory / f"{u}.key") for u in ids},
            certificates,
            draft("bench", aggregator=aggregator, silos=certificates.items()),
        )

    def peers(self) -> ConsortiumPeers:
        """One party's check of its peers: CA-issued, on the roster, not revoked; each has its own cache."""
        return ConsortiumPeers(MemberTrust(self.ca_pem, self.roster, RevokedSerials()))

    def signer(self, silo: str) -> Signer:
        key = self.keys[silo]
        return lambda data, *, context: sign(key, data, context=context)


@dataclass
class SessionRun:
    masking_s: dict[str, float]
    reading_s: dict[str, float]  # a silo's step on a total it unmasks itself (blind), by silo
    unmask_s: float
    up: dict[str, dict[str, int]]  # silo → message → serialized bytes
    down: dict[str, dict[str, int]]
    certificate_bytes: int  # of the PEMs in the key list


def stream_bytes(stream: Iterable[Message]) -> int:
    return sum(message.ByteSize() for message in stream)


class Relay:
    """A silo's stub answered as the aggregator's service answers it: each request measured (into `sizes`),
    read with the certificate the silo connected with as a message of `layer`, and handed to the aggregator's
    half; each total the silo fetches measured into `downloads`."""

    def __init__(
        self,
        silo: str,
        aggregator: AggregatorHalf,
        credential: bytes,
        sizes: dict[str, int],
        downloads: dict[str, int],
        layer: str,
    ) -> None:
        self.silo, self.aggregator, self.credential = silo, aggregator, credential
        self.sizes, self.downloads, self.layer = sizes, downloads, layer

    def __getattr__(self, rpc: str):
        if rpc not in receivers():
            raise AttributeError(rpc)

        def call(request, **_: object) -> None:
            self.sizes[type(request).__name__] = request.ByteSize()
            self.aggregator.receive(
                self.silo,
                received(rpc, request, silo=self.silo, credential=self.credential, layer=self.layer),
            )

        return call

    def Submit(self, stream, timeout=None) -> None:  # noqa: N802
        first, *parts = list(stream)
        self.sizes["Submit (masked)"] = stream_bytes([first, *parts])
        payload = b"".join(p.chunk for p in parts)
        self.aggregator.receive(self.silo, submitted(first.header, payload, layer=self.layer))

    def FetchSum(self, request: pb.FetchSumRequest, timeout=None) -> list[pb.FetchSumResponse]:  # noqa: N802
        data = self.aggregator.download(self.silo)
        parts = [pb.FetchSumResponse(offset=offset, data=part) for offset, part in chunks(data)]
        self.downloads["FetchSum (total)"] = sum(part.ByteSize() for part in parts)
        return parts


def layer_sides(
    layer: str, members: Members, silos: Iterable[str]
) -> tuple[dict[str, SiloSide], AggregatorSide]:
    """The layer's sides as the registry makes them, keyed as in a consortium: each silo signs with its
    certificate key and checks its peers' against the roster; a layer with a key service gets one key, made
    as its key holder makes it, for every silo and none for the aggregator."""
    made, service = make_layer(layer), layer_record(layer).key_service
    secret = None if service is None else service.new()
    silo_sides = {
        u: made.silo_side(PartyKeys(sign=members.signer(u), peers=members.peers(), secret=secret))
        for u in silos
    }
    return silo_sides, made.aggregator_side(PartyKeys(peers=members.peers()))


def run_session(
    spec: SumSpec,
    members: Members,
    inputs: Mapping[str, torch.Tensor],
    *,
    dropped: Mapping[str, str],
    layer: str = "secagg",
) -> SessionRun:
    """One secure sum as a consortium runs it: the layer's real halves, every message built and read through
    the consortium's wire (`privacy.wire`), a total announced for fetching fetched through FetchSum; times
    each silo's masking step, the aggregator's unmasking and each silo's reading of a total it unmasks.

    `dropped` maps a silo to the first stage it does not answer (one of `privacy.secagg.local.STAGES`).
    """
    # each silo verifies certificates with its own cache, as each agent process does; so does the aggregator
    silo_sides, aggregator_side = layer_sides(layer, members, spec.silos)
    aggregator = aggregator_side.half(spec)
    halves = {u: silo_sides[u].half(spec, u, may_release=lambda _: None) for u in spec.silos}
    up: dict[str, dict[str, int]] = {u: {} for u in spec.silos}
    down: dict[str, dict[str, int]] = {u: {} for u in spec.silos}
    stubs = {u: Relay(u, aggregator, members.certificates[u], up[u], down[u], layer) for u in spec.silos}
    masking: dict[str, float] = {}
    reading: dict[str, float] = {}
    certificates, unmask = 0, 0.0

    def answers(u: str, stage: str) -> bool:
        return u not in dropped or STAGES.index(dropped[u]) > STAGES.index(stage)

    outgoing = {u: halves[u].start(inputs[u]) for u in spec.silos if answers(u, "keys")}
    while True:
        for u, messages in outgoing.items():
            for message in messages:
                send(stubs[u], spec.round_id, spec.purpose, message, timeout=0)
        stage = aggregator.stage
        out, seconds = timed(aggregator.close)
        unmask = seconds if stage == "unmask" else unmask
        if isinstance(out, Released):
            break
        outgoing = {}
        for u, step in out.items():
            message = step_to_pb(spec.round_id, spec.purpose, step)
            down[u][type(step).__name__] = pb.JoinResponse(sum_step=message).ByteSize()
            certificates = (
                sum(len(k.credential) for k in step.keys) if isinstance(step, KeyList) else certificates
            )
            if answers(u, aggregator.stage):
                _, announced = step_from_pb(message, layer=layer)
                decoded = fetched(stubs[u], spec.round_id, spec.purpose, announced, timeout=0)
                outgoing[u], took = timed(lambda u=u, decoded=decoded: halves[u].step(decoded))
                if isinstance(decoded, Inbox):
                    masking[u] = took
                elif halves[u].done and halves[u].result is not None:
                    reading[u] = took
    readers = {"aggregator": out.total} if out.total is not None else {u: halves[u].result for u in reading}
    if not readers:
        raise RuntimeError(f"no party read the {layer} sum")
    for reader, total in readers.items():
        check_sum(spec.schema, out.survivors, total, inputs, reader=reader)
    return SessionRun(masking, reading, unmask, up, down, certificates)


def check_sum(
    schema: Schema,
    survivors: Iterable[str],
    total: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    reader: str,
) -> None:
    """The sum `reader` read is the fixed-point sum of the survivors' encoded inputs to the bit, and within
    the codec's stated bound of their float sum (where it rounds stochastically, each silo's draw is keyed by
    its own vector, so encoding it here draws the same)."""
    codec = FixedPointCodec(schema, max_silos=len(inputs))
    survivors = list(survivors)
    grid = codec.ring.zeros()
    for u in survivors:
        codec.ring.add(grid, codec.encode(inputs[u]))
    if not torch.equal(total, codec.decode(grid)):
        raise RuntimeError(f"the sum {reader} read is not the fixed-point sum of the survivors' inputs")
    truth = schema.unflatten(sum(inputs[u] for u in survivors))
    released = schema.unflatten(total)
    for f in schema.fields:
        error = float((released[f.name] - truth[f.name]).abs().max())
        if error > codec.error_bound(f.name):
            raise RuntimeError(f"the unmasked sum of {f.name} is off by {error:g}, beyond the codec's bound")


def flower_run(flower: Flower, n: int, holders: int, t: int, cases: list[str]) -> dict:
    """Flower SecAgg+ for n clients with `holders` = num_shares (n: every client), run by `flower.python` (a
    Python with flwr installed) in benchmarks/flower_secaggplus.py, one repeat: the seconds of a client's
    masked-input stage (median over clients) and of the server's unmask stage in each of `cases`; its
    start-up is not timed. Flower's threshold is ours, t, where its workflow takes it (t < num_shares);
    else num_shares − 1 (t = 3 of 3 at n = 3)."""
    script = Path(__file__).with_name("flower_secaggplus.py")
    command = [
        flower.python,
        str(script),
        *("--silos", str(n), "--shares", str(holders), "--threshold", str(flower_threshold(holders, t))),
        *("--shapes", json.dumps(flower.shapes), "--cases", *cases),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:2])} failed:\n{done.stderr.strip()}")
    out = json.loads(done.stdout)
    return {
        "masked_input_s": out["masked_input_s"][0],
        "unmask_s": {c: v[0] for c, v in out["unmask_s"].items()},
    }


def flower_threshold(holders: int, t: int) -> int:
    """Ours where Flower's workflow takes it: it refuses a reconstruction_threshold of num_shares or more."""
    return min(t, holders - 1)


def flower_version(flower: str) -> str:
    done = subprocess.run(
        [flower, "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True
    )
    return done.stdout.strip() or "not installed"


@dataclass
class Samples:
    """One layer's numbers over the repeats of `session_costs`: medians over silos, one per repeat."""

    masking: list[float] = field(default_factory=list)
    masking_total: list[float] = field(default_factory=list)  # every silo's masking, summed
    reading: list[float] = field(default_factory=list)  # a silo unmasking the total it was handed (blind)
    unmask: dict[str, list[float]] = field(default_factory=dict)
    sizes: SessionRun | None = None

    def add(self, scenario: str, run: SessionRun) -> None:
        self.unmask.setdefault(scenario, []).append(run.unmask_s)
        if scenario != "none":
            return
        self.masking.append(statistics.median(run.masking_s.values()))
        self.masking_total.append(sum(run.masking_s.values()))
        if run.reading_s:
            self.reading.append(statistics.median(run.reading_s.values()))
        self.sizes = run


def per_silo(table: dict[str, dict[str, int]], silos: Iterable[str]) -> dict[str, int]:
    """Mean over silos (ids differ in length by a byte or two)."""
    silos = list(silos)
    return {m: round(statistics.fmean(table[u][m] for u in silos)) for m in table[silos[0]]}


def session_costs(
    n: int,
    repeats: int,
    schema: Schema,
    members: Members,
    *,
    neighbours: int = 0,
    flower: Flower | None = None,
    others: tuple[str, ...] = (),
) -> dict:
    """Items 1–3 for n silos: medians over `repeats` fresh sessions (new keys and seeds every time).

    `neighbours` 0 is the consortium default, the complete graph; otherwise SecAgg+'s degree. The threshold
    is the default: more than two thirds of a seed's holders. With `flower`, each repeat also runs Flower
    SecAgg+ for the same n, model, holders per secret and dropout cases, right after ours (`flower_run`).
    Each layer of `others` (whose sum is secagg's session, `SESSION_LAYERS`) runs the same sessions in each
    repeat, in alternating order with secagg, and is reported under "layers" against secagg.
    """
    participants = tuple(sorted(f"silo-{k}" for k in range(n)))
    settings = SecAggSettings(neighbours=neighbours)
    codec = FixedPointCodec(schema, max_silos=n)
    ring = codec.ring
    flats = {u: contribution(schema, seed=k) for k, u in enumerate(participants)}
    encoded = codec.encode(flats[participants[0]])  # one silo's ring vector, for the timings without protocol
    shape = settings.session("r0", "contribution", participants, ring, b"")
    t, holders = shape.t, shape.holder_count
    # losing a silo leaves its neighbours holders - 1 holders of each other's seeds
    scenarios = [s for s in DROPOUTS if s == "none" or holders - 1 >= t]
    drop = participants[-1]
    layers = ("secagg", *others)

    for keystream in keystreams.KEYSTREAMS:  # warm up the ciphers and the allocator
        bare_keystream([secrets.token_bytes(keystreams.SEED_BYTES)], ring.nbytes, keystream)
    bare: dict[str, list[float]] = {k: [] for k in keystreams.KEYSTREAMS}
    ratios, apply_only, encode, decode, flowers, output_mask = [], [], [], [], [], []
    samples = {layer: Samples() for layer in layers}
    for repeat in range(repeats):
        # a silo's masks: self + peers
        seeds = [secrets.token_bytes(keystreams.SEED_BYTES) for _ in range(holders)]
        for keystream in keystreams.KEYSTREAMS:
            bare[keystream].append(bare_keystream(seeds, ring.nbytes, keystream))
        apply_only.append(masks_only(seeds, ring, encoded))
        encode.append(timed(lambda: codec.encode(flats[participants[0]]))[1])
        if "blind" in others:
            output_mask.append(output_mask_only(ring, encoded, participants[0]))
        for layer in layers[:: 1 if repeat % 2 == 0 else -1]:
            layer_settings = layer_record(layer).settings(neighbours=neighbours)
            for scenario in scenarios:
                round_id = f"r{repeat + 1}.a1.{secrets.token_hex(4)}"
                binding = secrets.token_bytes(32)
                spec = SumSpec(round_id, "contribution", participants, schema, binding, layer_settings)
                dropped = {drop: DROPOUTS[scenario]} if DROPOUTS[scenario] else {}
                samples[layer].add(scenario, run_session(spec, members, flats, dropped=dropped, layer=layer))
        ratios.append(samples["secagg"].masking[-1] / bare[keystreams.MASK_KEYSTREAM][-1])
        if flower is not None:
            flowers.append(flower_run(flower, n, holders, t, scenarios))
        decode.append(timed(lambda: codec.decode(encoded))[1])

    base = samples["secagg"]
    sizes = base.sizes
    assert sizes is not None
    up, down = per_silo(sizes.up, participants), per_silo(sizes.down, participants)
    plaintext_payload = to_wire(schema, torch.zeros(schema.size, dtype=torch.float64))
    plaintext_up = stream_bytes(
        submit_stream(
            "r1.a1.00000000", plaintext_payload, kind=pb.CONTRIBUTION_KIND_PLAINTEXT, purpose="contribution"
        )
    )
    float32_bytes = 4 * schema.size  # the contribution's numbers as float32: the model's entries and n
    ours = [m + e for m, e in zip(base.masking, encode, strict=True)]
    return {
        "silos": n,
        "neighbours": neighbours,
        "holders": holders,
        "threshold": t,
        "words": schema.size,
        "ring": {"wide_words": ring.wide, "narrow_words": ring.narrow, "bytes": ring.nbytes},
        "encodings": {
            e.field.name: {"bits": e.bits, "frac_bits": e.frac_bits, "stochastic": e.stochastic}
            for e in codec.encodings
        },
        "repeats": repeats,
        "masking_s_median": median(base.masking),
        "masking_all_silos_s_median": median(base.masking_total),
        "bare_keystream_s_median": median(bare[keystreams.MASK_KEYSTREAM]),
        "bare_keystream_s_median_by_cipher": {k: median(v) for k, v in bare.items()},
        "keystream": keystreams.MASK_KEYSTREAM,
        "ratio_masking_over_bare": median(ratios, 3),
        "ratio_samples": [round(r, 3) for r in ratios],
        "apply_mask_only_s_median": median(apply_only),
        "keystream_gb_per_s": {
            k: round(holders * ring.nbytes / statistics.median(v) / 1e9, 2) for k, v in bare.items()
        },
        "codec_encode_s_median": median(encode),
        "codec_decode_s_median": median(decode),
        "flower": None if flower is None else against_flower(flowers, ours, base.unmask, holders, t),
        "unmask_s_median": {s: median(base.unmask[s]) if s in base.unmask else None for s in DROPOUTS},
        "unmask_note": ""
        if len(scenarios) == len(DROPOUTS)
        else f"no dropout case: losing one of {holders} holders leaves {holders - 1} < t = {t}, the session "
        "would abort",
        "bytes_per_silo": {
            "up": up,
            "down": down,
            "up_total": sum(up.values()),
            "down_total": sum(down.values()),
            "key_list_certificates": sizes.certificate_bytes,
            "float32_contribution": float32_bytes,
            "ratio_up_over_float32": round(sum(up.values()) / float32_bytes, 4),
            "ratio_up_and_down_over_float32": round(
                (sum(up.values()) + sum(down.values())) / float32_bytes, 4
            ),
            "plaintext_payload": len(plaintext_payload),
            "plaintext_up": plaintext_up,
            "ratio_up_over_plaintext": round(sum(up.values()) / plaintext_up, 4),
        },
        "layers": {
            layer: against_secagg(samples[layer], base, participants, float32_bytes)
            | ({"output_mask_only_s_median": median(output_mask)} if layer == "blind" else {})
            for layer in others
        },
    }


def against_flower(
    runs: list[dict], ours: list[float], unmask: Mapping[str, list[float]], holders: int, t: int
) -> dict:
    """Flower's repeats (`flower_run`) against ours in the same loop: each ratio is Flower's time over ours
    per repeat, then the median."""

    def ratio(theirs: Iterable[float], mine: Iterable[float]) -> float:
        return round(statistics.median(f / o for f, o in zip(theirs, mine, strict=True)), 2)

    cases = list(runs[0]["unmask_s"])
    return {
        "num_shares": holders,
        "threshold": flower_threshold(holders, t),
        "masked_input_stage_s_median": median(r["masked_input_s"] for r in runs),
        "samples": [round(r["masked_input_s"], 4) for r in runs],
        "ratio_flower_over_ours": ratio((r["masked_input_s"] for r in runs), ours),
        "ours": "encode + masked_input (the codec, the envelopes, key agreement, every mask)",
        "unmask_s_median": {c: median(r["unmask_s"][c] for r in runs) for c in cases},
        "ratio_unmask_flower_over_ours": {
            c: ratio((r["unmask_s"][c] for r in runs), unmask[c]) for c in cases
        },
        "unmask": "Flower's unmask_stage, its clients' answers excluded, against the aggregator half's close "
        "of our unmask stage (close_unmask and the codec's decode)",
    }


def output_mask_only(ring: Ring, vector: np.ndarray, silo: str) -> float:
    """Seconds for one blind output mask alone (`privacy.blind.keys.add_mask`: one keystream, its HMAC
    seed): what a blind silo's masking adds to secagg's."""
    target, key = vector.copy(), OutputKey.new()
    started = time.perf_counter()
    add_mask(ring, target, key, sum_label("r1.a1.x", "contribution", secrets.token_bytes(32)), silo)
    return time.perf_counter() - started


def blind_round_bytes(model: str, n: int) -> dict[str, int]:
    """What a blind silo sends and is sent each round besides the contribution sum, as silos step the model:
    the sealed next state (every silo the sum counted reports it, in a ReportState stream; each fetches one
    at the next round's start, where a secagg silo fetches the aggregator's packed state), its masked
    evaluation counts (inside that report) and the counts' total handed back (a SumStep)."""
    method = plan_for(model).build_method()
    state = method.init_state(seed=0)
    packed = pack_state(state)
    sealed = seal_state(
        OutputKey.new(), consortium="bench", round_number=1, digest=state.digest(), packed=packed
    )
    silos = tuple(f"silo-{k}" for k in range(n))
    ring = FixedPointCodec(evaluation_schema(method.model_spec.num_classes), max_silos=n).ring
    _, counts = payload_of(MaskedCounts(bytes(ring.nbytes)))
    total = step_to_pb("r1.a1.00000000", "evaluation", CountsTotal(bytes(ring.nbytes), silos))
    return {
        "packed_state": len(packed),
        "sealed_state": len(sealed),
        "sealed_state_stream": stream_bytes(pb.ReportStateRequest(chunk=c) for _, c in chunks(sealed)),
        "masked_counts_payload": len(counts),
        "counts_total_step": pb.JoinResponse(sum_step=total).ByteSize(),
    }


def against_secagg(samples: Samples, base: Samples, silos: tuple[str, ...], float32_bytes: int) -> dict:
    """A layer's costs in the same sessions as secagg's: its times and bytes, each with its ratio to secagg's
    (per repeat, then the median). Every session checked that each party reading the sum read the
    fixed-point sum of the survivors' inputs to the bit (`check_sum`)."""
    assert samples.sizes is not None
    assert base.sizes is not None
    up, down = per_silo(samples.sizes.up, silos), per_silo(samples.sizes.down, silos)
    fetched_down = [m for m in down if m.startswith("FetchSum")]
    base_up = sum(per_silo(base.sizes.up, silos).values())
    base_down = sum(per_silo(base.sizes.down, silos).values())

    def over_secagg(values: list[float], secagg: list[float]) -> float:
        return median((v / s for v, s in zip(values, secagg, strict=True)), 3)

    return {
        "masking_s_median": median(samples.masking),
        "ratio_masking_over_secagg": over_secagg(samples.masking, base.masking),
        "masking_all_silos_s_median": median(samples.masking_total),
        "reading_s_median": median(samples.reading) if samples.reading else None,
        "unmask_s_median": {s: median(v) for s, v in samples.unmask.items()},
        "ratio_unmask_over_secagg": over_secagg(samples.unmask["none"], base.unmask["none"]),
        "sum": "each reader's sum is the fixed-point sum of the survivors' inputs, to the bit",
        "bytes_per_silo": {
            "up": up,
            "down": down,
            "up_total": sum(up.values()),
            "down_total": sum(down.values()),
            "total_fetched": sum(down[m] for m in fetched_down),
            "float32_contribution": float32_bytes,
            "ratio_up_over_float32": round(sum(up.values()) / float32_bytes, 4),
            "ratio_total_fetched_over_float32": round(sum(down[m] for m in fetched_down) / float32_bytes, 4),
            "ratio_up_over_secagg": round(sum(up.values()) / base_up, 4),
            "down_beyond_secagg": sum(down.values()) - base_down,
        },
    }


@dataclass(frozen=True)
class Flower:
    python: str  # an interpreter with flwr installed
    shapes: list[list[int]]  # the model's parameter arrays, as Flower's client would hold them


def model_shapes(model: str) -> list[list[int]]:
    method = plan_for(model).build_method()
    state = method.init_state(seed=0)
    return [list(state.model[k].shape) for k in float_keys(state.model)]


def session(
    silos: list[int],
    repeats: list[int],
    model: str,
    graphs: tuple[str, ...] = ("full",),
    flower: str = "",
    layers: tuple[str, ...] = ("secagg",),
    full_up_to: int = FULL_UP_TO,
) -> dict:
    """Every n with each graph of `graphs`, the graphs in turn for each n (a drift of the machine then shows
    in both graphs' numbers at that n rather than between them), `repeats[i]` repeats at `silos[i]` (one
    value: at every n). SecAgg+ is skipped where its degree gives the complete graph (n = 3): that row would
    repeat the full graph's; the full graph beyond `full_up_to` silos, whose n² pairwise work would take the
    run's time (both said under "skipped"). With `flower` (a Python with flwr), Flower SecAgg+ runs beside
    each row with as many holders per secret. `layers` starts with secagg, the others' baseline; blind's
    entries also carry what its silos send per round besides the sum. Each graph measured at three n or more
    gets its growth fitted (`growth`)."""
    per_n = repeats_per_n(silos, repeats)
    schema = contribution_schema(model)
    against = Flower(flower, model_shapes(model)) if flower else None
    rows = [(n, graph) for n in silos for graph in graphs]
    skipped = [
        {"silos": n, "graph": graph, "reason": reason}
        for n, graph in rows
        if (reason := skip_reason(n, graph, full_up_to))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        members = Members.issue(Path(tmp), max(silos))
        results = [
            {"graph": graph}
            | session_costs(
                n,
                per_n[n],
                schema,
                members,
                neighbours=neighbours_for(graph, n),
                flower=against,
                others=layers[1:],
            )
            for n, graph in rows
            if not skip_reason(n, graph, full_up_to)
        ]
    for r in results:
        if "blind" in r["layers"]:
            r["layers"]["blind"]["per_round"] = blind_round_bytes(model, r["silos"])
    return {
        "machine": machine(),
        "model": model,
        "words": schema.size,
        "graphs": list(graphs),
        "layers": list(layers),
        "flwr": flower_version(flower) if flower else None,
        "by_silos": results,
        "skipped": skipped,
        "growth": {graph: growth([r for r in results if r["graph"] == graph]) for graph in graphs},
    }


LAWS: dict[str, Callable[[float], float]] = {
    "log n": math.log,
    "n": float,
    "n log n": lambda n: n * math.log(n),
    "n^2": lambda n: n * n,
}


def fit_growth(ns: Sequence[int], ys: Sequence[float]) -> dict:
    """Least squares of y = a + b · law(n) for each law of LAWS (a: what does not grow with n, such as a
    silo's self mask), each with its relative RMS residual; the best law, the one of smallest residual
    among those that grow (b > 0); and the log-log slope, the exponent e of the least-squares y = c · n^e.

    >>> fit = fit_growth([10, 30, 100, 300], [2 + 3 * n * math.log(n) for n in (10, 30, 100, 300)])
    >>> fit["best"], round(fit["laws"]["n log n"]["b"], 9), round(fit["laws"]["n log n"]["rms_relative"], 9)
    ('n log n', 3.0, 0.0)
    >>> round(fit_growth([10, 100, 1000], [5 * n**2 for n in (10, 100, 1000)])["loglog_slope"], 9)
    2.0
    """
    n, y = np.asarray(ns, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    laws = {}
    for name, law in LAWS.items():
        design = np.column_stack([np.ones_like(n), [law(v) for v in n]])
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        rms = float(np.sqrt(np.mean(((design @ [a, b] - y) / y) ** 2)))
        laws[name] = {"a": float(a), "b": float(b), "rms_relative": rms}
    growing = {name: fit for name, fit in laws.items() if fit["b"] > 0}
    slope = float(np.polyfit(np.log(n), np.log(y), 1)[0])
    return {
        "silos": [int(v) for v in ns],
        "values": [float(v) for v in ys],
        "laws": laws,
        "best": min(growing, key=lambda name: growing[name]["rms_relative"]) if growing else None,
        "loglog_slope": slope,
    }


def growth(rows: list[dict]) -> dict:
    """One graph's costs against n (`fit_growth`), each measured at three n or more: a silo's masking, all
    silos' masking, the aggregator's unmasking in each dropout case, and the bytes per silo (all of them, and
    the protocol's alone: without the masked vector)."""
    rows = sorted(rows, key=lambda r: r["silos"])
    series: dict[str, list[tuple[int, float]]] = {}

    def add(name: str, n: int, value: float | None) -> None:
        if value is not None:
            series.setdefault(name, []).append((n, value))

    for r in rows:
        n, b = r["silos"], r["bytes_per_silo"]
        add("masking_s", n, r["masking_s_median"])
        add("masking_all_silos_s", n, r["masking_all_silos_s_median"])
        for case, seconds in r["unmask_s_median"].items():
            add(f"unmask_s_{case}", n, seconds)
        add("bytes_up", n, b["up_total"])
        add("bytes_down", n, b["down_total"])
        add("protocol_bytes", n, b["up_total"] + b["down_total"] - b["up"]["Submit (masked)"])
    return {
        name: fit_growth(*zip(*points, strict=True)) for name, points in series.items() if len(points) >= 3
    }


def repeats_per_n(silos: list[int], repeats: list[int]) -> dict[int, int]:
    """`--repeats`: one count for every n, or one per n of `silos`."""
    if len(repeats) not in (1, len(silos)):
        raise ValueError(f"give one repeat count, or one per n ({len(silos)}), not {len(repeats)}")
    return dict(zip(silos, repeats * len(silos) if len(repeats) == 1 else repeats, strict=True))


def skip_reason(n: int, graph: str, full_up_to: int) -> str:
    """Why this row is not run, or "" if it is."""
    if graph == "full" and n > full_up_to:
        return (
            f"the complete graph beyond {full_up_to} silos: every silo masks with n − 1 peers, n² masks in "
            "all, too slow for one process on this machine"
        )
    if graph != "full" and not neighbours_for(graph, n):
        return "SecAgg+'s degree reaches n − 1 here: the complete graph, the full row"
    return ""


def session_table(result: dict) -> str:
    graphs = result.get("graphs", ["full"]) != ["full"]
    flower = result.get("flwr") is not None
    rows = [
        f"{'n':>3} {'t':>3} {'mask s':>7} {'bare s':>7} {'ratio':>6} {'chacha s':>8} {'encode s':>8} "
        f"{'unmask s none/after/before':>27} {'up B':>9} {'down B':>8} {'f32 B':>9} {'up/f32':>7}"
        + (
            f" {'flower s':>8} {'x':>5} {'fl m':>4} {'fl t':>4} {'flower unmask s':>17} {'x unmask':>14}"
            if flower
            else ""
        )
        + (f" {'graph':>7} {'k':>3} {'all silos mask s':>16}" if graphs else "")
    ]
    for r in result["by_silos"]:
        unmask = "/".join("-" if v is None else f"{v:.3f}" for v in r["unmask_s_median"].values())
        b = r["bytes_per_silo"]
        k = r["neighbours"] or r["silos"] - 1
        against = r["flower"] or {}
        versus = flower_cells(against) if flower else ""
        graph = f" {r['graph']:>7} {k:>3} {r['masking_all_silos_s_median']:>16.3f}" if graphs else ""
        rows.append(
            f"{r['silos']:>3} {r['threshold']:>3} {r['masking_s_median']:>7.3f} "
            f"{r['bare_keystream_s_median']:>7.3f} {r['ratio_masking_over_bare']:>6.3f} "
            f"{r['bare_keystream_s_median_by_cipher']['chacha20']:>8.3f} {r['codec_encode_s_median']:>8.4f} "
            f"{unmask:>27} {b['up_total']:>9} {b['down_total']:>8} {b['float32_contribution']:>9} "
            f"{b['ratio_up_over_float32']:>7.4f}{versus}{graph}"
        )
    return "\n".join([*rows, *layers_table(result), *growth_table(result)])


def flower_cells(against: dict) -> str:
    """Flower's columns of a session row: its masked-input stage, ours over it, its holders and threshold,
    its unmask stage in each case and its ratio to ours ("-" where Flower did not run)."""
    if not against:
        return f" {'-':>8} {'-':>5} {'-':>4} {'-':>4} {'-':>17} {'-':>14}"
    unmask = "/".join(f"{v:.3f}" for v in against["unmask_s_median"].values())
    ratios = "/".join(f"{v:.1f}" for v in against["ratio_unmask_flower_over_ours"].values())
    return (
        f" {against['masked_input_stage_s_median']:>8.4f} {against['ratio_flower_over_ours']:>5.1f}"
        f" {against['num_shares']:>4} {against['threshold']:>4} {unmask:>17} {ratios:>14}"
    )


def growth_table(result: dict) -> list[str]:
    """Each graph's fitted growth (`fit_growth`): the best law, the log-log slope and every law's residual."""
    rows = [
        f"{'graph':>7} {'cost':>26} {'n':>16} {'best':>8} {'slope':>6} "
        + " ".join(f"{'rms ' + law:>11}" for law in LAWS)
    ]
    for graph, fits in result.get("growth", {}).items():
        for cost, fit in fits.items():
            rows.append(
                f"{graph:>7} {cost:>26} {','.join(map(str, fit['silos'])):>16} {fit['best'] or '-':>8} "
                f"{fit['loglog_slope']:>6.3f} "
                + " ".join(f"{fit['laws'][law]['rms_relative']:>11.4f}" for law in LAWS)
            )
    return rows if len(rows) > 1 else []


def layers_table(result: dict) -> list[str]:
    """The other layers' rows, against secagg's in the same sessions (none where only secagg ran)."""
    rows = [
        f"{'n':>3} {'layer':>6} {'mask s':>7} {'x sec':>6} {'out s':>6} {'read s':>7} {'unmask s':>8} "
        f"{'x sec':>6} {'up B':>9} {'up/f32':>7} {'up/sec':>7} {'fetched B':>9} {'f/f32':>7} {'down+ B':>9}"
    ]
    for r in result["by_silos"]:
        for layer, c in r.get("layers", {}).items():
            b = c["bytes_per_silo"]
            rows.append(
                f"{r['silos']:>3} {layer:>6} {c['masking_s_median']:>7.3f} "
                f"{c['ratio_masking_over_secagg']:>6.3f} "
                f"{c.get('output_mask_only_s_median', 0):>6.3f} {c['reading_s_median'] or 0:>7.3f} "
                f"{c['unmask_s_median']['none']:>8.3f} {c['ratio_unmask_over_secagg']:>6.3f} "
                f"{b['up_total']:>9} {b['ratio_up_over_float32']:>7.4f} {b['ratio_up_over_secagg']:>7.4f} "
                f"{b['total_fetched']:>9} {b['ratio_total_fetched_over_float32']:>7.4f} "
                f"{b['down_beyond_secagg']:>9}"
            )
    return rows if len(rows) > 1 else []


# --- item 4: a real consortium, layer against layer -------------------------------------------------------


class RoundTimes(NamedTuple):
    """Milliseconds (Unix) at which the committed attempt of a round started, last took a contribution, and
    was committed, from the audit log."""

    number: int
    started: int
    last_in: int
    committed: int


def round_times(audit: list[AuditRecord]) -> list[RoundTimes]:
    started: dict[str, int] = {}
    last_in: dict[str, int] = {}
    times = []
    for record in audit:  # in order, so the last contribution of an attempt is the one kept
        round_id = record.detail.get("round_id", "")
        if record.event == "attempt_started":
            started[round_id] = record.at_ms
        elif record.event == "contribution_accepted":
            last_in[round_id] = record.at_ms
        elif record.event == "round_committed":
            times.append(
                RoundTimes(record.detail["round"], started[round_id], last_in[round_id], record.at_ms)
            )
    return times


def consortium_run(
    directory: Path,
    *,
    silos: int,
    n_rounds: int,
    privacy: str,
    model: str,
    silo_threads: int,
    budget_s: float,
    recipe: DataConfig | None = None,
    layer_settings: object | None = None,
    silo_policy: Mapping[str, int] | None = None,
    monitor: Callable[[Consortium], AbstractContextManager[dict]] | None = None,
) -> dict:
    """One consortium run: its per-round times from the audit log, and its last evaluation.

    `recipe` is the data (by default `recipe_for(model)`; its `silos` is set to `silos`), `layer_settings`
    the privacy layer's section (the demo's by default), `silo_policy` settings added to every silo's
    `[policy]`, and `monitor` watches the processes while they run: it is entered before they start, and
    what it yields, filled in by then, is the run's "monitor" entry.
    """
    _, configs = write_consortium(
        directory,
        recipe=replace(recipe or recipe_for(model), silos=silos),
        plan=plan_for(model),
        consortium=ConsortiumSection(id="bench-secagg", rounds=n_rounds, min_silos=silos, privacy=privacy),
        timeouts=TimeoutSection(gather=5.0, round=budget_s, stage=budget_s),
        silo_threads=silo_threads,
        layer_settings=demo_layer_settings(privacy) if layer_settings is None else layer_settings,
    )
    for path in configs:
        add_to_policy(path, silo_policy or {})
    consortium = Consortium(directory, configs)
    load_before = loadavg()
    started = time.monotonic()
    code: int | None = None
    watching = monitor(consortium) if monitor else nullcontext({})
    try:
        with watching as watched:
            consortium.start()
            code = consortium.wait_aggregator(timeout=budget_s)
    except AssertionError:
        pass  # over budget: report what was committed
    finally:
        consortium.stop()
    wall = time.monotonic() - started
    store = consortium.store()
    try:
        audit = store.audit_log()
        evaluated = store.metrics_history()
    finally:
        store.close()
    times = round_times(audit)
    later = times[1:]  # the first round's time includes start-up
    training = slowest_training(directory)
    rounds_trained = [(a, b) for a, b in itertools.pairwise(times) if b.number in training]
    run = {
        "privacy": privacy,
        "measured": code == 0 and len(times) == n_rounds and len(times) > 1,
        "aggregator_exit_code": code,
        "rounds_committed": len(times),
        "attempts": sum(r.event == "attempt_started" for r in audit),
        "wall_s": round(wall, 1),
        "loadavg_before": load_before,  # 1, 5 and 15 minutes: others' work on this machine shows here
        "loadavg_after": loadavg(),
        "round_s": [(b.committed - a.committed) / 1000 for a, b in itertools.pairwise(times)],
        "start_to_last_contribution_s": [(r.last_in - r.started) / 1000 for r in later],
        "last_contribution_to_commit_s": [(r.committed - r.last_in) / 1000 for r in later],
        "commit_to_next_start_s": [(b.started - a.committed) / 1000 for a, b in itertools.pairwise(times)],
        "slowest_training_s": [training[b.number] for _, b in rounds_trained],
        "beyond_training_s": [
            (b.committed - a.committed) / 1000 - training[b.number] for a, b in rounds_trained
        ],
        # the two layers' models differ by fixed-point rounding after round 1 (~1e-8), then drift apart as
        # training amplifies it, so compare what they reach rather than their weights
        "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
    }
    if monitor:
        run["monitor"] = watched
    if code is None:
        run["reason"] = f"stopped after {budget_s / 60:.0f} minutes with {len(times)}/{n_rounds} rounds"
    elif code != 0:
        run["reason"] = f"the aggregator exited with {code}: " + " | ".join(consortium.output[-5:])
    return run


TRAINED = re.compile(r"round (\d+): trained on \d+ samples in ([0-9.]+) s")  # silo.work's log line


def slowest_training(directory: Path) -> dict[int, float]:
    """Per round, the slowest silo's local training in seconds, from the silos' logs: the same work under
    every layer (their models agree to the bit or nearly), and the part of a round that others' load on this
    shared machine moves most, so a round's time beyond it is the steadier measure of what a layer costs."""
    slowest: dict[int, float] = {}
    for log in directory.glob("silo-*.log"):
        for number, seconds in TRAINED.findall(log.read_text()):
            slowest[int(number)] = max(slowest.get(int(number), 0.0), float(seconds))
    return slowest


def add_to_policy(silo_config: Path, settings: Mapping[str, int]) -> None:
    """Settings added to the `[policy]` table of a silo config `write_consortium` wrote (which sets none of
    them), such as `min_neighbours` for a silo that accepts SecAgg+ graphs."""
    if not settings:
        return
    text = silo_config.read_text()
    if text.count("\n[policy]\n") != 1:
        raise ValueError(f"{silo_config}: expected one [policy] table")
    lines = "".join(f"{key} = {value}\n" for key, value in settings.items())
    silo_config.write_text(text.replace("\n[policy]\n", f"\n[policy]\n{lines}"))


PHASES = (
    "round_s",
    "start_to_last_contribution_s",
    "last_contribution_to_commit_s",
    "commit_to_next_start_s",
)
TRAINING = ("slowest_training_s", "beyond_training_s")  # per round with a training line in the silos' logs


def pooled(runs: list[dict]) -> dict:
    """One layer's runs together: medians over all their rounds after the first."""
    summary: dict = {"measured": bool(runs) and all(r["measured"] for r in runs)}
    if summary["measured"]:
        summary |= {f"{p}_median": median((x for r in runs for x in r[p]), 3) for p in PHASES}
        summary |= {
            f"{p}_median": median((x for r in runs for x in r[p]), 3)
            for p in TRAINING
            if all(r.get(p) for r in runs)
        }
    else:
        summary["reason"] = "; ".join(r["reason"] for r in runs if "reason" in r) or "not run"
    summary["runs"] = [
        {k: [round(x, 3) for x in v] if k in (*PHASES, *TRAINING) else v for k, v in r.items()} for r in runs
    ]
    return summary


def rounds(
    silos: list[int],
    n_rounds: int,
    pairs: int,
    model: str,
    silo_threads: int,
    budget_minutes: float,
    keep: str,
    layers: tuple[str, ...] = ("plaintext", "secagg"),
) -> dict:
    """Runs alternate plaintext, secagg, secagg, plaintext, ... (every layer of `layers`, forwards then
    backwards) so that a slow drift of this shared machine favours no layer; the first layer is the others'
    baseline."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep) if keep else Path(tmp)
        for n in silos:
            runs: dict[str, list[dict]] = {layer: [] for layer in layers}
            for pair in range(pairs):
                for privacy in layers[:: 1 if pair % 2 == 0 else -1]:
                    run = consortium_run(
                        root / f"n{n}-{pair}-{privacy}",
                        silos=n,
                        n_rounds=n_rounds,
                        privacy=privacy,
                        model=model,
                        silo_threads=silo_threads,
                        budget_s=60 * budget_minutes,
                    )
                    runs[privacy].append(run)
                    if not run["measured"]:
                        break  # failed or over budget: so would the other layer and the next pair
                if not run["measured"]:
                    break
            results.append({"silos": n, **compared(runs, layers)})
    return {
        "machine": machine(),
        "model": model,
        "words": contribution_schema(model).size,
        "rounds": n_rounds,
        "pairs": pairs,
        "silo_threads": silo_threads,
        "budget_minutes": budget_minutes,
        "layers": list(layers),
        "baseline": layers[0],
        "by_silos": results,
    }


def compared(runs: Mapping[str, list[dict]], layers: tuple[str, ...]) -> dict:
    """Each layer's runs pooled (`pooled`), and each layer's median round time over the first layer's: over
    all their rounds, and per pair of runs (the runs of one pass through the layers, forwards or backwards);
    None where either layer was not measured."""
    baseline = layers[0]
    entry: dict = {layer: pooled(runs[layer]) for layer in layers}
    base = entry[baseline]
    for layer in layers[1:]:
        entry[f"ratio_{layer}_over_{baseline}"] = None
        if base["measured"] and entry[layer]["measured"]:
            entry[f"ratio_{layer}_over_{baseline}"] = round(
                entry[layer]["round_s_median"] / base["round_s_median"], 3
            )
            entry[f"ratio_{layer}_per_pair"] = [
                round(statistics.median(s["round_s"]) / statistics.median(p["round_s"]), 3)
                for p, s in zip(runs[baseline], runs[layer], strict=True)
            ]
            if "beyond_training_s_median" in base and "beyond_training_s_median" in entry[layer]:
                entry[f"beyond_training_{layer}_minus_{baseline}_s"] = round(
                    entry[layer]["beyond_training_s_median"] - base["beyond_training_s_median"], 3
                )
    return entry


def rounds_table(result: dict) -> str:
    layers, baseline = result["layers"], result["baseline"]
    rows = [
        f"{'n':>3} "
        + " ".join(f"{layer + ' s/round':>17}" for layer in layers)
        + " "
        + " ".join(f"{f'{layer}/{baseline}':>16}" for layer in layers[1:])
        + "   beyond training ("
        + " | ".join(layers)
        + ", s)   phases ("
        + " | ".join(layers)
        + "): start → last contribution / → commit / → next start (s)"
    ]

    def cell(run: dict, width: int) -> str:
        return f"{run['round_s_median']:>{width}.3f}" if run["measured"] else f"{'not measured':>{width}}"

    def phases(run: dict) -> str:
        return "/".join(f"{run[f'{p}_median']:.3f}" for p in PHASES[1:]) if run["measured"] else run["reason"]

    def beyond(run: dict) -> str:
        return f"{run['beyond_training_s_median']:.3f}" if "beyond_training_s_median" in run else "-"

    for r in result["by_silos"]:
        ratios = [r[f"ratio_{layer}_over_{baseline}"] for layer in layers[1:]]
        rows.append(
            f"{r['silos']:>3} "
            + " ".join(cell(r[layer], 17) for layer in layers)
            + " "
            + " ".join(f"{f'{ratio:.3f}' if ratio else '-':>16}" for ratio in ratios)
            + "   "
            + " | ".join(beyond(r[layer]) for layer in layers)
            + "   "
            + " | ".join(phases(r[layer]) for layer in layers)
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("session", help="masking, unmasking and bytes on the wire, in one process")
    s.add_argument("--silos", type=int, nargs="+", default=[3, 10, 30])
    s.add_argument(
        "--repeats", type=int, nargs="+", default=[5], help="at every n, or one count per n of --silos"
    )
    s.add_argument(
        "--full-up-to",
        type=int,
        default=FULL_UP_TO,
        metavar="N",
        help="run the complete graph up to N silos only (its n² pairwise work)",
    )
    s.add_argument("--model", default="resnet8")
    s.add_argument(
        "--graphs", nargs="+", choices=GRAPHS, default=["full"], help="secagg+: 2⌈log2 n⌉ neighbours per silo"
    )
    s.add_argument(
        "--layers",
        nargs="+",
        choices=SESSION_LAYERS,
        default=["secagg"],
        help="secagg first: the others run the same sessions and are reported against it",
    )
    r = commands.add_parser("rounds", help="a real consortium's round time, layer against layer")
    r.add_argument("--silos", type=int, nargs="+", default=[3, 10])
    r.add_argument("--rounds", type=int, default=6, help="per run; the first is excluded from the median")
    r.add_argument("--pairs", type=int, default=2, help="runs of each layer, in alternating order")
    r.add_argument("--model", default="resnet8")
    r.add_argument("--silo-threads", type=int, default=SILO_THREADS, help="torch threads per silo")
    r.add_argument("--budget-minutes", type=float, default=15.0, help="per run; beyond it, not measured")
    r.add_argument("--keep", default="", help="keep the consortium directories (logs, database) here")
    r.add_argument(
        "--layers",
        nargs="+",
        choices=consortium_layers(),
        default=["plaintext", "secagg"],
        help="the first is the others' baseline",
    )
    s.add_argument(
        "--flower",
        default="",
        metavar="PYTHON",
        help="a Python with flwr installed (its own venv): Flower SecAgg+'s masked-input and unmask stages "
        "beside ours",
    )
    args = parser.parse_args()
    if args.command == "session":
        if args.layers[0] != "secagg" or len(set(args.layers)) < len(args.layers):
            s.error("--layers starts with secagg, the others' baseline, and names each layer once")
        try:
            repeats_per_n(args.silos, args.repeats)
        except ValueError as exc:
            s.error(f"--repeats: {exc}")
        result = session(
            args.silos,
            args.repeats,
            args.model,
            tuple(args.graphs),
            args.flower,
            tuple(args.layers),
            args.full_up_to,
        )
        table = session_table(result)
    else:
        if len(set(args.layers)) < max(2, len(args.layers)):
            r.error("--layers names two layers or more, each once: the first is the others' baseline")
        result = rounds(
            args.silos,
            args.rounds,
            args.pairs,
            args.model,
            args.silo_threads,
            args.budget_minutes,
            args.keep,
            tuple(args.layers),
        )
        table = rounds_table(result)
    print(json.dumps(result, indent=1))
    print(table, file=sys.stderr)


if __name__ == "__main__":
    main()
