"""The RoundSpec, one module for both ends: the aggregator builds and signs it, the silo opens and reads it.

A RoundSpec says everything a silo needs to decide whether to take part and to check what it is shown; it
travels as bytes inside `SignedRoundSpec`, so the signature covers exactly what the silo parses. The privacy
layer's parameters ride in the layer's own field (`PARAMETERS`, a table keyed by layer name: a layer adds its
entry, no caller compares names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from google.protobuf.message import DecodeError

from fedlt.aggregation import Schema, layers, record
from fedlt.aggregation.round_sums import RoundSums
from fedlt.aggregation.tail_guard import Census, guard_of
from fedlt.config import as_table, parse_section
from fedlt.errors import FedltError
from fedlt.v1 import round_pb2
from fedlt.wire import census_from_pb, census_to_pb, schema_from_pb, schema_to_pb
from fedlt.wire.codec import BadLayerMessage, entries_of, from_entries
from privacy.pki.signing import ROUNDSPEC_CONTEXT, verify
from privacy.stepping.attestation import Attested


class RoundSpecError(FedltError):
    """Signed bytes that are not a RoundSpec."""


def _write(privacy: str, settings: object) -> dict[str, object]:
    """The layer's parameters as RoundSpec fields: its own (`RoundParameters`), or its settings dataclass
    carried by name through the generic codec; none for a layer without settings."""
    layer = record(privacy)
    if layer.parameters is not None:
        return layer.parameters.write(settings)
    return {} if settings is None else {"layer_parameters": entries_of(settings)}


def build(
    *,
    consortium_id: str,
    round_number: int,
    attempt: int,
    round_id: str,
    method: str,
    plan_toml: str,
    schema: Schema,
    state_digest: str,
    state_bytes: int,
    seed: int,
    privacy: str,
    settings: object,
    participants: Sequence[str],
    disclosures: Sequence[str],
    disclosers: Sequence[str],
    deadline_unix_ms: int,
    census: Census | None,
    attested: Attested | None = None,
) -> round_pb2.RoundSpec:
    """`attested`: where silos computed the starting state, every counted silo's signature over it."""
    return round_pb2.RoundSpec(
        consortium_id=consortium_id,
        round=round_number,
        attempt=attempt,
        round_id=round_id,
        method=method,
        schema=schema_to_pb(schema),
        method_config=plan_toml,
        config_sha256=hashlib.sha256(plan_toml.encode()).hexdigest(),
        state_digest=state_digest,
        state_bytes=state_bytes,
        seed=seed,
        privacy=privacy,
        participants=participants,
        disclosures=disclosures,
        disclosers=disclosers,
        deadline_unix_ms=deadline_unix_ms,
        census=None if census is None else census_to_pb(census),
        attestations=None if attested is None else attested.to_pb(),
        **_write(privacy, settings),
    )


def sign(spec: round_pb2.RoundSpec, signer: Callable[[bytes], bytes]) -> round_pb2.SignedRoundSpec:
    blob = spec.SerializeToString()
    return round_pb2.SignedRoundSpec(spec=blob, signature=signer(blob))


def open_signed(signed: round_pb2.SignedRoundSpec, signer_cert) -> round_pb2.RoundSpec:
    """The RoundSpec, once its signature verifies with `signer_cert` (PkiError otherwise)."""
    verify(signer_cert, signed.signature, signed.spec, context=ROUNDSPEC_CONTEXT)
    try:
        return round_pb2.RoundSpec.FromString(signed.spec)
    except DecodeError:
        raise RoundSpecError("a signed RoundSpec that does not parse") from None


def settings_of(spec: round_pb2.RoundSpec) -> object:
    """The layer's parameters as signed (None for a layer without any, or one not installed here)."""
    layer = layers().get(spec.privacy)
    if layer is None:
        return None
    if layer.parameters is not None:
        return layer.parameters.read(spec)
    if layer.settings is None:
        return None
    try:
        settings = from_entries(spec.layer_parameters, layer.settings)
    except BadLayerMessage as exc:
        raise RoundSpecError(f"the {spec.privacy} parameters: {exc}") from None
    problems: list[str] = []  # within the limits its fields declare, as consortium.toml's reading checks
    parse_section(layer.settings, as_table(settings), spec.privacy, problems)
    if problems:
        raise RoundSpecError(f"the {spec.privacy} parameters: {'; '.join(problems)}")
    return settings


def sums_of(signed: round_pb2.SignedRoundSpec, spec: round_pb2.RoundSpec) -> RoundSums:
    """The round's sums as both ends derive them: participants, schema, tail guard, census, binding."""
    settings = settings_of(spec)
    return RoundSums(
        round_id=spec.round_id,
        participants=tuple(sorted(spec.participants)),
        schema=schema_from_pb(spec.schema),
        k_min=guard_of(settings).k_min,
        record_floor=guard_of(settings).min_records,
        census=census_from_pb(spec),
        binding=hashlib.sha256(signed.spec).digest(),
        settings=settings,
    )
