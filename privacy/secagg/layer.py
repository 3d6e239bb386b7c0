"""The `secagg` privacy layer: its settings, and both halves for silos that live in one process.

In the simulator every silo gets a fresh signing key for the run, and the halves talk through the in-process
transport of `fedlt.aggregation.sums`; the consortium builds the same halves with certificates and the silo's
policy (`SecAggSiloSide`, `SecAggAggregatorSide`). The decoded sum is the same whichever masks were drawn, so
a seeded simulation gives the numbers the consortium gives.

`LAYER` is its record in the registry (`fedlt.aggregation.registry`): its sum, settings, RoundSpec
parameters and messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from fractions import Fraction

from cryptography.hazmat.primitives.asymmetric import ec

from fedlt.aggregation import SumLayer
from fedlt.aggregation.halves import AggregatorSide, PartyKeys, SiloSide
from fedlt.aggregation.registry import LayerRecord, RoundParameters
from fedlt.v1 import round_pb2
from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.secagg import wire
from privacy.secagg.halves import SecAggAggregatorSide, SecAggSiloSide
from privacy.secagg.settings import SecAggSettings, SessionPolicy


class SecAggSum(SumLayer):
    name = "secagg"

    def __init__(self, settings: SecAggSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or SecAggSettings()

    def describe(self) -> str:
        return self.settings.describe()

    def silo_side(self, keys: PartyKeys[SessionPolicy, None]) -> SiloSide:
        return SecAggSiloSide(sign=keys.sign, peers=keys.peers, policy=keys.policy)

    def aggregator_side(self, keys: PartyKeys[None, None]) -> AggregatorSide:
        return SecAggAggregatorSide(peers=keys.peers)

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        identities = {u: ec.generate_private_key(ec.SECP256R1()) for u in silos}
        peers = KeyPeers({u: key.public_key() for u, key in identities.items()})
        sides = {
            u: self.silo_side(
                PartyKeys(
                    sign=lambda data, *, context, key=key: sign(key, data, context=context), peers=peers
                )
            )
            for u, key in identities.items()
        }
        return sides, self.aggregator_side(PartyKeys(peers=peers))


def _read(spec: round_pb2.RoundSpec) -> SecAggSettings:
    return SecAggSettings(
        threshold=spec.secagg.threshold,
        neighbours=spec.secagg.neighbours,
        k_min=spec.secagg.k_min,
        min_records=spec.secagg.min_records,
    )


def _policy(section) -> SessionPolicy:
    """A silo's minimums for secure sums, from its [policy] section."""
    return SessionPolicy(
        min_participants=section.min_participants,
        threshold_above=Fraction(section.threshold_above),
        min_neighbours=section.min_neighbours,
    )


LAYER = LayerRecord(
    name="secagg",
    layer=SecAggSum,
    settings=SecAggSettings,
    parameters=RoundParameters(
        write=lambda settings: {"secagg": round_pb2.SecAggParameters(**asdict(settings))}, read=_read
    ),
    wire=wire.WIRE,
    policy=_policy,
)
