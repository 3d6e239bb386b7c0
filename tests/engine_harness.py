"""The real round driver and the silos' own `Participation`, in one process with the network left out.

What the gRPC service would relay is handed straight to the round inbox (`DirectStub`, which decodes requests
as the service does, minus certificates and streams); each `InProcessSilo` plays an agent's part on a thread:
a `Participation` per RoundSpec, steps as directives arrive, a refusal ends its part in the attempt (as
`silo.finish` does) and is recorded for the test to read.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.inbox import RoundInbox
from fedlt.aggregation import Schema
from fedlt.aggregation.gate import Floors, ReleaseGate
from fedlt.aggregation.halves import PartyKeys
from fedlt.errors import FedltError
from fedlt.v1 import round_pb2
from fedlt.wire import PURPOSE_OF_SUM, schema_from_pb
from privacy import roundspec
from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.secagg.layer import SecAggSum
from privacy.secagg.settings import SessionPolicy
from privacy.wire import received, receivers, submitted
from silo.participation import Participation
from silo.releases import ReleaseLedger
from silo.transport import SiloTransport

# what a silo contributes to a round: its values for the schema's fields, from the round's number
Values = Callable[[Schema, int], dict[str, torch.Tensor]]


class DirectStub:
    """The silo's calls handed straight to the round inbox, read as the gRPC service reads them (no
    certificates: the in-process peers check bare keys)."""

    def __init__(self, inbox: RoundInbox, silo: str) -> None:
        self.inbox, self.silo = inbox, silo

    def __getattr__(self, rpc: str):
        if rpc not in receivers():
            raise AttributeError(rpc)

        def call(request, **_: object) -> None:
            layer = self.inbox.config.consortium.privacy
            message = received(rpc, request, silo=self.silo, credential=b"", layer=layer)
            self.inbox.deliver(self.silo, request.round_id, PURPOSE_OF_SUM[request.sum], message)

        return call

    def Submit(self, stream, timeout=None) -> None:  # noqa: N802
        first, *parts = list(stream)
        header = first.header
        payload = b"".join(part.chunk for part in parts)
        upload = submitted(header, payload, layer=self.inbox.config.consortium.privacy)
        self.inbox.upload(self.silo, header.round_id, PURPOSE_OF_SUM[header.sum], upload, header.sha256)


class InProcessSilo:
    """`records`: the silo's record count per class, for the census's record floor (None: it says none)."""

    def __init__(self, name: str, values: Values, state_dir: Path, records: np.ndarray | None = None) -> None:
        self.name, self.values, self.state_dir, self.records = name, values, state_dir, records
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.refusals: list[str] = []
        self.errors: list[str] = []
        self.done = threading.Event()  # a contribution sum of this silo completed

    def start(self, inbox: RoundInbox, peers: KeyPeers, stop: threading.Event) -> threading.Thread:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        thread = threading.Thread(target=self._play, args=(inbox, peers, stop), daemon=True)
        thread.start()
        return thread

    def _play(self, inbox: RoundInbox, peers: KeyPeers, stop: threading.Event) -> None:
        session = inbox.connect(self.name)
        stub = DirectStub(inbox, self.name)
        taking_part: Participation | None = None
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
                        taking_part = self._participation(directive.round_spec, peers, stub)
                        taking_part.start()
                    elif kind == "sum_step" and taking_part is not None:
                        taking_part.step(directive.sum_step)
                        if taking_part.done:
                            self.done.set()
                    elif kind == "abort":
                        taking_part = None
                except FedltError as exc:  # the agent's `Finish.stage`: leave this attempt's sums
                    self.refusals.append(str(exc))
                    taking_part = None
        except Exception as exc:  # reported by the test thread
            self.errors.append(f"{self.name}: {exc!r}")
        finally:
            inbox.disconnect(session)

    def _participation(
        self, signed: round_pb2.SignedRoundSpec, peers: KeyPeers, stub: DirectStub
    ) -> Participation:
        spec = round_pb2.RoundSpec.FromString(signed.spec)
        schema = schema_from_pb(spec.schema)
        values = schema.unflatten(torch.zeros(schema.size, dtype=torch.float64))
        values.update(self.values(schema, spec.round))
        sign_as = lambda data, *, context: sign(self.key, data, context=context)  # noqa: E731
        ledger = ReleaseLedger(self.state_dir)
        return Participation(
            spec,
            roundspec.sums_of(signed, spec),
            schema.flatten(values),
            me=self.name,
            side=SecAggSum().silo_side(PartyKeys(sign=sign_as, peers=peers, policy=SessionPolicy())),
            gate=ReleaseGate(
                consortium=spec.consortium_id, floors=Floors(), members=lambda: peers.keys, ledger=ledger
            ),
            trained_from=spec.state_digest,  # the state these silos "train" from: the one the RoundSpec signs
            ledger=ledger,
            records=self.records,
            transport=SiloTransport(stub, timeout=30),
            on_sent=lambda purpose, message: None,
        )


def peers_of(silos: list[InProcessSilo]) -> KeyPeers:
    return KeyPeers({s.name: s.key.public_key() for s in silos})
