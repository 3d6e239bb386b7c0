"""The `ckks` layer's record in the registry (`fedlt.aggregation.registry`): its sum, settings, RoundSpec
parameters, messages, and the capabilities it asks of the runtime: the key service (one silo makes the key,
sealed to every other) and "silos step" (`CkksSum.silos_step`: only silos read its sums)."""

from __future__ import annotations

from dataclasses import asdict

from fedlt.aggregation.registry import KeyKind, LayerRecord, RoundParameters
from fedlt.v1 import round_pb2
from privacy.ckks import wire
from privacy.ckks.keys import PublicContext, SecretContext
from privacy.ckks.layer import CkksSum
from privacy.ckks.settings import CkksParameters, CkksSettings


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
