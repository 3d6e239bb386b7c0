"""The real round engine and the silos' own `SecureRound`, in one process with the network left out.

What the gRPC service would relay is handed straight to the engine (`DirectStub`); each `InProcessSilo` plays
an agent's part on a thread: a `SecureRound` per RoundSpec, steps as directives arrive, a refusal ends its
part in the attempt (as `silo.agent` does) and is recorded for the test to read.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.rounds import RoundEngine
from fedlt.aggregation import Schema
from fedlt.errors import FedltError
from fedlt.v1 import round_pb2
from privacy.pki.signing import sign
from privacy.secagg import wire
from privacy.secagg.peers import KeyPeers
from privacy.secagg.policy import SessionPolicy
from privacy.secagg.protocol import AdvertisedKeys
from silo.agent import _schema_of
from silo.releases import ReleaseLedger
from silo.secure import SecureRound

# what a silo contributes to a round: its values for the schema's fields, from the round's number
Values = Callable[[Schema, int], dict[str, torch.Tensor]]


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


class InProcessSilo:
    def __init__(self, name: str, values: Values, state_dir: Path) -> None:
        self.name, self.values, self.state_dir = name, values, state_dir
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.refusals: list[str] = []
        self.errors: list[str] = []
        self.done = threading.Event()  # a contribution sum of this silo completed

    def start(self, engine: RoundEngine, peers: KeyPeers, stop: threading.Event) -> threading.Thread:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        thread = threading.Thread(target=self._play, args=(engine, peers, stop), daemon=True)
        thread.start()
        return thread

    def _play(self, engine: RoundEngine, peers: KeyPeers, stop: threading.Event) -> None:
        session = engine.connect(self.name)
        stub = DirectStub(engine, self.name)
        secure: SecureRound | None = None
        try:
            while not stop.is_set():
                try:
                    directive = session.directives.get(timeout=1.0)
                except queue.Empty:
                    continue
                if directive is None:
                    return
                kind = directive.WhichOneof("directive")
                try:
                    if kind == "round_spec":
                        secure = self._secure_round(directive.round_spec, peers)
                        secure.start(stub)
                    elif kind == "secagg_step" and secure is not None:
                        secure.step(stub, directive.secagg_step, stub.Submit)
                        if secure.done:
                            self.done.set()
                    elif kind == "abort":
                        secure = None
                except FedltError as exc:  # the agent's `_secure_call`: leave this attempt's secure sum
                    self.refusals.append(str(exc))
                    secure = None
        except Exception as exc:  # reported by the test thread
            self.errors.append(f"{self.name}: {exc!r}")
        finally:
            engine.disconnect(session)

    def _secure_round(self, signed: round_pb2.SignedRoundSpec, peers: KeyPeers) -> SecureRound:
        spec = round_pb2.RoundSpec.FromString(signed.spec)
        schema = _schema_of(spec)
        values = schema.unflatten(torch.zeros(schema.size, dtype=torch.float64))
        values.update(self.values(schema, spec.round))
        return SecureRound(
            signed,
            spec,
            schema,
            schema.flatten(values),
            me=self.name,
            sign=lambda data, *, context: sign(self.key, data, context=context),
            peers=peers,
            policy=SessionPolicy(),
            ledger=ReleaseLedger(self.state_dir),
            timeout=30,
        )


def peers_of(silos: list[InProcessSilo]) -> KeyPeers:
    return KeyPeers({s.name: s.key.public_key() for s in silos})
