"""The `blind` privacy layer: its settings, and both halves for silos that live in one process.

In the simulator one output key is made for the run and shared by every silo, as the key service shares it
in a consortium, and every silo gets a fresh signing key for the run, as under secagg; the aggregator's side
holds nothing of the key. The silos decode the same fixed-point sum secagg's aggregator decodes, so a seeded
run gives secagg's numbers to the bit.

`LAYER` is its record in the registry (`fedlt.aggregation.registry`): its sum, settings (carried in the
RoundSpec by name), messages, secagg's policy hook, and the capabilities it asks of the runtime: the key
service (the key holder makes the output key, sealed to every other silo) and "silos step"
(`BlindSum.silos_step`: only silos read its sums).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec

from fedlt.aggregation import SumLayer
from fedlt.aggregation.halves import AggregatorSide, PartyKeys, SiloSide
from fedlt.aggregation.registry import KeyKind, LayerRecord
from fedlt.config import setting
from privacy.blind import wire
from privacy.blind.halves import BlindAggregatorSide, BlindSiloSide, CountsTotal, KeyLookup, MaskedCounts
from privacy.blind.keys import OutputKey, Withheld, read_public
from privacy.blind.wire import TotalReady
from privacy.keyservice.relay import KeyRelay
from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.secagg.layer import LAYER as SECAGG
from privacy.secagg.settings import SecAggSettings, SessionPolicy


@dataclass(frozen=True)
class BlindSettings(SecAggSettings):
    """secagg's settings (threshold, graph, tail guard), the silo that makes the output key, and, as a
    RoundSpec signs them, the key every silo must mask with (the aggregator names it from the key service)."""

    key_holder: str = setting(
        "", doc="the silo that makes the consortium's output key and seals it to every other"
    )
    context_id: str = setting(
        "", doc="set in each RoundSpec from the key service; leave it out of consortium.toml"
    )

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        found = super().consortium_problems(min_silos, per_round)
        if not self.key_holder:
            found.append("blind.key_holder: name the silo that makes the consortium's output key")
        if self.context_id:
            found.append("blind.context_id: the key service names the key in each RoundSpec; leave it out")
        return found

    def describe(self) -> str:
        return (
            "blind — the aggregator sees neither inputs nor sums, so no model: silos step the model under an "
            f"output key made by {self.key_holder or '?'}; the aggregator with one silo gets the sums, "
            f"never a single input; {self.describe_session()}"
        )


class BlindSum(SumLayer):
    name = "blind"
    silos_step = True

    def __init__(self, settings: BlindSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or BlindSettings()

    def describe(self) -> str:
        return self.settings.describe()

    def silo_side(self, keys: PartyKeys[SessionPolicy, OutputKey | KeyLookup]) -> SiloSide:
        """`keys.secret`: the output key, or (a consortium silo) its keyring's lookup by parameters."""
        secret = keys.secret
        if isinstance(secret, OutputKey):
            return BlindSiloSide(lambda _: secret, sign=keys.sign, peers=keys.peers, policy=keys.policy)
        if not callable(secret):
            raise ValueError("a silo takes part in blind sums only with the consortium's output key")
        return BlindSiloSide(secret, sign=keys.sign, peers=keys.peers, policy=keys.policy)

    def aggregator_side(self, keys: PartyKeys[None, KeyRelay | Withheld | None]) -> AggregatorSide:
        """`keys.secret`: the key service's relay in a consortium, which holds nothing of the key (elsewhere
        nothing, or what the key service would give the aggregator: `Withheld`)."""
        if isinstance(keys.secret, KeyRelay):
            return BlindAggregatorSide(peers=keys.peers, keys=keys.secret)
        if keys.secret is not None and not isinstance(keys.secret, Withheld):
            raise ValueError("the aggregator holds no part of the output key, only the key service's relay")
        return BlindAggregatorSide(peers=keys.peers)

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        key = OutputKey.new()
        identities = {u: ec.generate_private_key(ec.SECP256R1()) for u in silos}
        peers = KeyPeers({u: identity.public_key() for u, identity in identities.items()})
        sides = {
            u: BlindSiloSide(
                lambda _: key,
                sign=lambda data, *, context, identity=identity: sign(identity, data, context=context),
                peers=peers,
            )
            for u, identity in identities.items()
        }
        return sides, BlindAggregatorSide(peers=peers)


LAYER = LayerRecord(
    name="blind",
    layer=BlindSum,
    settings=BlindSettings,
    wire=wire.WIRE,
    messages=(TotalReady, MaskedCounts, CountsTotal),
    uploads=(MaskedCounts,),
    key_service=KeyKind(
        new=OutputKey.new, from_secret_bytes=OutputKey.from_secret_bytes, read_public=read_public
    ),
    policy=SECAGG.policy,
)
