"""The one generic codec for layers' dataclass messages, and the one field-by-name mapping for messages with
Protobuf forms of their own: what goes in comes back, and anything else is refused, never coerced."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedlt.aggregation.schema import Field, Schema
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import layer_pb2
from fedlt.wire import Mapped, schema_from_pb, schema_to_pb
from fedlt.wire.codec import BadLayerMessage, WireError, decode, encode, entries_of, from_entries


@dataclass(frozen=True)
class Inner:
    name: str
    weight: float


@dataclass(frozen=True)
class Outer:
    blob: bytes
    count: int
    ok: bool
    silos: tuple[str, ...]
    by_silo: Mapping[str, bytes]
    inner: Inner
    note: str | None = None
    inners: tuple[Inner, ...] = field(default=())


TYPES = {"test.Outer": Outer}
texts = st.text(max_size=8)
inners = st.builds(Inner, texts, st.floats(allow_nan=False))
outers = st.builds(
    Outer,
    st.binary(max_size=32),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.tuples(texts, texts),
    st.dictionaries(texts, st.binary(max_size=8), max_size=4),
    inners,
    st.none() | texts,
    st.lists(inners, max_size=3).map(tuple),
)


@given(outers)
def test_what_goes_in_comes_back(message):
    wire = layer_pb2.LayerMessage.FromString(encode(message, "test.Outer").SerializeToString())
    assert decode(wire, TYPES) == message


def test_a_type_no_layer_declared_is_refused():
    with pytest.raises(BadLayerMessage, match="no layer carries"):
        decode(layer_pb2.LayerMessage(type="os.system"), TYPES)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda e: e.entries["stranger"].CopyFrom(layer_pb2.Value(int_value=1)), "no field 'stranger'"),
        (lambda e: e.entries.pop("blob"), "without its field 'blob'"),
        (
            lambda e: e.entries["count"].CopyFrom(layer_pb2.Value(string_value="1")),
            "string_value where a int",
        ),
        (lambda e: e.entries["ok"].CopyFrom(layer_pb2.Value(int_value=1)), "int_value where a bool"),
        (lambda e: e.entries["silos"].CopyFrom(layer_pb2.Value(bytes_value=b"x")), "where a list belongs"),
        (lambda e: e.entries["inner"].CopyFrom(layer_pb2.Value(bytes_value=b"x")), "where a Inner belongs"),
    ],
)
def test_a_message_that_does_not_read_back_as_its_dataclass_is_refused(change, refusal):
    entries = entries_of(Outer(b"b", 1, True, ("a",), {"a": b"x"}, Inner("n", 1.0)))
    change(entries)
    with pytest.raises(BadLayerMessage, match=refusal):
        from_entries(entries, Outer)


def test_only_dataclasses_travel():
    with pytest.raises(WireError, match="no dataclass"):
        encode(object(), "test.Object")


def test_a_schema_travels_field_by_field_and_a_field_the_message_lacks_is_refused_at_once():
    schema = Schema((Field("delta", (3, 2), 4.0, frac_bits=20, per_class=True, inverts=True),), phase="p")
    assert schema_from_pb(schema_to_pb(schema)) == schema

    @dataclass(frozen=True)
    class Widened:
        sender: str
        recipient: str
        ciphertext: bytes
        nonce: bytes  # a field the wire does not carry: refused when the mapping is declared, not dropped

    with pytest.raises(TypeError, match=r"carries no field for Widened\.nonce"):
        Mapped(Widened, pb.EncryptedShare)
