"""The census and the tail guard through the real round engine and the silo's `SecureRound`, in one process.

FedAvg has no per-class field, so no consortium method runs the census yet; this test gives FedAvg one and
connects the silos' protocol code to the engine directly (what the gRPC service would relay), to check that
classes held by fewer than k_min silos come out of the released sum as zeros, and that the audit log names
the classes held back and nothing about who holds them.
"""

from __future__ import annotations

import queue
import threading

import torch
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.config import ConsortiumConfig, ConsortiumSection, TimeoutSection
from aggregator.rounds import RoundEngine
from aggregator.store import Store
from fedlt.aggregation import Field, Schema
from fedlt.methods.fedavg import FedAvg
from fedlt.v1 import round_pb2
from privacy.pki.signing import sign
from privacy.secagg import wire
from privacy.secagg.layer import SecAggSum
from privacy.secagg.peers import KeyPeers
from privacy.secagg.protocol import AdvertisedKeys
from silo.agent import _schema_of
from silo.secure import SecureRound
from tests.consortium_harness import PLAN

CLASSES = 4
HOLDINGS = {"a": (0, 1), "b": (0, 1, 2), "c": (0, 3)}  # silos per class: 3, 2, 1, 1


class PerClassFedAvg(FedAvg):
    """FedAvg plus a per-class field, whose sums it keeps for the test to read."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sums_seen: list[dict[str, torch.Tensor]] = []

    def schema(self, state):
        extra = Field("per_class", (CLASSES, 2), 100.0, per_class=True)
        return Schema((*super().schema(state).fields, extra))

    def _server_step(self, state, sums, ctx):
        self.sums_seen.append({k: v.clone() for k, v in sums.items()})
        return super()._server_step(state, sums, ctx)


class DirectStub:
    """The silo's calls handed straight to the engine, as the gRPC service would after reading the caller."""

    def __init__(self, engine: RoundEngine, silo: str) -> None:
        self.engine, self.silo = engine, silo

    def _to(self, request, action) -> None:
        self.engine.secagg(self.silo, request.round_id, wire.PURPOSE_OF_SUM[request.sum], action)

    def AdvertiseKeys(self, request, timeout=None) -> None:  # noqa: N802
        keys = AdvertisedKeys(self.silo, request.c_public_key, request.s_public_key, request.signature)
        self._to(request, lambda server: server.add_keys(self.silo, keys))

    def ShareKeys(self, request, timeout=None) -> None:  # noqa: N802
        envelopes = wire.envelopes_from_pb(request.shares)
        self._to(request, lambda server: server.add_envelopes(self.silo, envelopes))

    def Consistency(self, request, timeout=None) -> None:  # noqa: N802
        self._to(request, lambda server: server.add_signature(self.silo, request.signature))

    def Unmask(self, request, timeout=None) -> None:  # noqa: N802
        self._to(request, lambda server: server.add_reveal(self.silo, wire.reveal_from_pb(request)))

    def Submit(self, stream, timeout=None) -> None:  # noqa: N802
        header, *chunks = list(stream)
        payload = b"".join(part.chunk for part in chunks)
        purpose = wire.PURPOSE_OF_SUM[header.header.sum]
        self.engine.submit_masked(self.silo, header.header.round_id, purpose, payload, header.header.sha256)


def play_silo(engine: RoundEngine, silo: str, key, peers: KeyPeers, errors: list) -> None:
    try:
        session = engine.connect(silo)
        stub = DirectStub(engine, silo)
        secure = None
        while secure is None or not secure.done:
            directive = session.directives.get(timeout=30)
            if directive.HasField("round_spec"):
                signed = directive.round_spec
                spec = round_pb2.RoundSpec.FromString(signed.spec)
                schema = _schema_of(spec)
                values = schema.unflatten(torch.zeros(schema.size, dtype=torch.float64))
                values["n"] = torch.tensor(5.0, dtype=torch.float64)
                for c in HOLDINGS[silo]:
                    values["per_class"][c] = torch.tensor([1.0, c + 0.5])
                secure = SecureRound(
                    signed,
                    spec,
                    schema,
                    schema.flatten(values),
                    me=silo,
                    sign=lambda data, *, context: sign(key, data, context=context),
                    peers=peers,
                    timeout=30,
                )
                secure.start(stub)
            elif directive.HasField("secagg_step"):
                secure.step(stub, directive.secagg_step, stub.Submit)
    except (Exception, queue.Empty) as exc:  # reported by the test thread
        errors.append(f"{silo}: {exc!r}")


def test_census_holds_back_classes_fewer_than_k_min_silos_hold(tmp_path):
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=1, min_silos=3),
        timeouts=TimeoutSection(gather=0.1, round=60.0, stage=30.0),
        plan=PLAN,
    )
    assert config.consortium.privacy == "secagg"
    assert config.secagg.k_min == 2
    identities = {silo: ec.generate_private_key(ec.SECP256R1()) for silo in HOLDINGS}
    peers = KeyPeers({silo: key.public_key() for silo, key in identities.items()})
    store = Store(tmp_path / "db.sqlite")
    for silo in HOLDINGS:
        store.register_silo(silo, "c", "v", {})
    method = PerClassFedAvg(
        options=PLAN.method.options,
        train=PLAN.train,
        model=PLAN.build_method().model_spec,
        rounds=config.consortium.rounds,
    )
    engine = RoundEngine(
        config=config,
        store=store,
        method=method,
        layer=SecAggSum(),
        sign=lambda blob: b"not checked here",
        recorder=None,
        peers=peers,
        echo=lambda _: None,
    )
    errors: list[str] = []
    silos = [
        threading.Thread(target=play_silo, args=(engine, s, identities[s], peers, errors), daemon=True)
        for s in HOLDINGS
    ]
    for thread in silos:
        thread.start()
    stop = threading.Event()
    driver = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    driver.start()
    driver.join(timeout=60)
    stop.set()
    assert not errors
    assert engine.failure is None
    assert engine.state.round == 1
    (sums,) = method.sums_seen
    expected = torch.zeros(CLASSES, 2, dtype=torch.float64)
    expected[0] = torch.tensor([3.0, 1.5])  # three silos hold class 0
    expected[1] = torch.tensor([2.0, 3.0])  # two hold class 1: exactly k_min, released
    assert torch.allclose(sums["per_class"], expected, atol=1e-6)  # classes 2 and 3: one silo each, zeroed
    assert float(sums["n"]) == 15.0
    guard = [r.detail for r in store.audit_log() if r.event == "tail_guard"]
    assert guard == [{"round_id": guard[0]["round_id"], "k_min": 2, "held_back": [2, 3]}]
    store.close()
