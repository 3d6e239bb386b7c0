"""The `ckks` privacy layer: its settings, and both halves for silos that live in one process.

In the simulator one secret context is made for the run and shared by every silo, as the key service shares
it in a consortium (`privacy.keyservice.ceremony`), and every silo gets a fresh signing key for the run, as
under secagg, so the consistency step runs the consortium's code; the aggregator's side holds the public
context only.

`LAYER` is its record in the registry (`fedlt.aggregation.registry`): its sum, settings, RoundSpec
parameters, messages, and the capabilities it asks of the runtime: the key service (one silo makes the key,
sealed to every other) and "silos step" (`CkksSum.silos_step`: only silos read its sums).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

from cryptography.hazmat.primitives.asymmetric import ec

from fedlt.aggregation import SumLayer
from fedlt.aggregation.halves import AggregatorSide, PartyKeys, SiloSide
from fedlt.aggregation.registry import KeyKind, LayerRecord, RoundParameters
from fedlt.v1 import round_pb2
from privacy.ckks import wire
from privacy.ckks.halves import CkksAggregatorSide, CkksSiloSide
from privacy.ckks.keys import PublicContext, SecretContext
from privacy.ckks.settings import CkksParameters, CkksSettings
from privacy.keyservice.relay import KeyRelay
from privacy.peers import KeyPeers
from privacy.pki.signing import sign

# a consortium silo's keyring: the key a round's signed parameters name
KeyLookup = Callable[[object], SecretContext]


class CkksSum(SumLayer):
    name = "ckks"
    silos_step = True

    def __init__(self, settings: CkksSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or CkksSettings()

    def describe(self) -> str:
        return self.settings.describe()

    def silo_side(self, keys: PartyKeys[None, SecretContext | KeyLookup]) -> SiloSide:
        """`keys.secret`: the secret context, or (a consortium silo) its keyring's lookup by parameters;
        `keys.sign` and `keys.peers` sign and check the consistency step."""
        secret = keys.secret
        if isinstance(secret, SecretContext):
            return CkksSiloSide(lambda _: secret, sign=keys.sign, peers=keys.peers)
        if not callable(secret):
            raise ValueError("a silo takes part in CKKS sums only with the consortium's secret context")
        return CkksSiloSide(secret, sign=keys.sign, peers=keys.peers)

    def aggregator_side(self, keys: PartyKeys[None, PublicContext | KeyRelay]) -> AggregatorSide:
        """`keys.secret`: the public context, or (a consortium) the key service's relay
        (`privacy.keyservice.relay.KeyRelay`), which receives it from the key holder."""
        if not isinstance(keys.secret, PublicContext | KeyRelay):  # never the secret context
            raise ValueError("the aggregator adds CKKS ciphertexts with the public context")
        return CkksAggregatorSide(keys.secret)

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        secret = SecretContext.new()
        identities = {u: ec.generate_private_key(ec.SECP256R1()) for u in silos}
        peers = KeyPeers({u: key.public_key() for u, key in identities.items()})
        sides = {
            u: CkksSiloSide(
                lambda _: secret,
                sign=lambda data, *, context, key=key: sign(key, data, context=context),
                peers=peers,
            )
            for u, key in identities.items()
        }
        return sides, CkksAggregatorSide(secret.public)


def _read(spec: round_pb2.RoundSpec) -> CkksParameters:
    ckks = spec.ckks
    return CkksParameters(
        k_min=ckks.k_min, min_records=ckks.min_records, context_id=ckks.context_id, key_holder=ckks.key_holder
    )


LAYER = LayerRecord(
    name="ckks",
    layer=CkksSum,
    settings=CkksSettings,
    parameters=RoundParameters(
        write=lambda settings: {"ckks": round_pb2.CkksParameters(**asdict(settings))}, read=_read
    ),
    wire=wire.WIRE,
    key_service=KeyKind(
        new=SecretContext.new,
        from_secret_bytes=SecretContext.from_secret_bytes,
        read_public=PublicContext.from_bytes,
    ),
)
