"""The consortium's state as the aggregator holds it: in the clear, or sealed by silos it cannot read.

Under most layers the aggregator steps the model itself and holds the `GlobalState`. Under a layer whose sums
only silos can read (ckks), silos step the model, seal the new state and report its digest, the next round's
schema and how many rounds remain, each with its signature over the digest
(`privacy.stepping.attestation`); the aggregator keeps exactly that, signatures included (`attested`: the
next RoundSpec carries them, and silos step from the state only if every silo its sum counted signed it), and
streams the sealed bytes to the next round's silos. The first state is the method's seeded initial state,
public anyway, so it is held in the clear. What the store keeps of a sealed state is a framed record: a JSON
header of those facts, then the sealed bytes, so a restarted aggregator still has the signatures.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedlt.aggregation import Schema
from fedlt.methods import GlobalState, Method
from fedlt.methods.state import pack_state, unpack_state
from fedlt.v1 import round_pb2
from fedlt.wire import schema_from_pb, schema_to_pb
from privacy.stepping.attestation import Attestation, Attested

SEALED = b"FSEALED1"


@dataclass(frozen=True)
class HeldState:
    round: int
    digest: str
    blob: bytes = field(repr=False)  # what FetchState streams: packed, or sealed by silos
    schema: Schema  # of the coming round
    remaining: int  # rounds the method still needs
    trains: bool  # whether the coming round trains (else a closing statistics round over every silo)
    model: GlobalState | None = field(default=None, repr=False)  # None when only silos can read the state
    attested: Attested | None = field(default=None, repr=False)  # of a sealed state: its silos' signatures

    @classmethod
    def plain(cls, state: GlobalState, method: Method) -> HeldState:
        return cls(
            state.round,
            state.digest(),
            pack_state(state),
            method.schema(state),
            method.remaining_rounds(state),
            method.trains(state),
            state,
        )

    @classmethod
    def sealed(
        cls,
        round_number: int,
        digest: str,
        blob: bytes,
        schema: Schema,
        remaining: int,
        trains: bool,
        attested: Attested | None,
    ) -> HeldState:
        return cls(round_number, digest, blob, schema, remaining, trains, attested=attested)

    @classmethod
    def reported(
        cls,
        round_number: int,
        counted: tuple[str, ...],
        readers: tuple[str, ...],
        reports: Mapping[str, StateReport],
    ) -> HeldState:
        """The state every silo that read the sum (`readers`, of `counted`) reported (the caller checked they
        agree), signatures kept."""
        first = reports[readers[0]]
        attested = Attested(counted, {silo: reports[silo].attestation for silo in readers})
        return cls.sealed(
            round_number, first.digest, first.sealed, first.schema, first.remaining, first.trains, attested
        )

    def stored(self) -> bytes:
        if self.model is not None:
            return self.blob
        header = json.dumps(
            {
                "digest": self.digest,
                "schema": schema_to_pb(self.schema).SerializeToString().hex(),
                "remaining": self.remaining,
                "trains": self.trains,
                "attested": "" if self.attested is None else self.attested.to_pb().SerializeToString().hex(),
            }
        ).encode()
        return SEALED + struct.pack("<I", len(header)) + header + self.blob

    @classmethod
    def from_stored(cls, data: bytes, round_number: int, digest: str, method: Method) -> HeldState:
        """What `stored` wrote; ValueError if it does not match the digest the store keeps beside it."""
        if not data.startswith(SEALED):
            held = cls.plain(unpack_state(data, round_number), method)
        else:
            (length,) = struct.unpack_from("<I", data, len(SEALED))
            start = len(SEALED) + 4
            facts = json.loads(data[start : start + length])
            schema = schema_from_pb(round_pb2.Schema.FromString(bytes.fromhex(facts["schema"])))
            blob = data[start + length :]
            attested = _attested(facts.get("attested", ""))
            held = cls.sealed(
                round_number, facts["digest"], blob, schema, facts["remaining"], facts["trains"], attested
            )
        if held.digest != digest:
            raise ValueError(f"stored state of round {round_number} does not match its digest")
        return held


def _attested(stored: str) -> Attested | None:
    """A sealed state's signatures as `stored` wrote them; None if none were kept (a store from before they
    were), which the next round's silos refuse."""
    if not stored:
        return None
    return Attested.from_pb(round_pb2.StateAttestations.FromString(bytes.fromhex(stored)))


@dataclass(frozen=True)
class StateReport:
    """What a silo that stepped the model reports: the sealed state, what the aggregator needs to run the next
    round without reading it, the silo's evaluation counts as an upload of the round's layer, and its
    signature over the state for `round` from the sum that counted `counted` (checked by the service)."""

    digest: str
    sealed: bytes = field(repr=False)
    schema: Schema
    remaining: int
    trains: bool
    evaluation: object = field(repr=False)
    round: int
    counted: tuple[str, ...]
    attestation: Attestation = field(repr=False)

    def same_state(self, other: StateReport) -> bool:
        return (self.digest, self.schema, self.remaining, self.trains) == (
            other.digest,
            other.schema,
            other.remaining,
            other.trains,
        )
