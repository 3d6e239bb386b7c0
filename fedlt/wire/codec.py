"""One way to put a layer's dataclass messages on the wire: a `LayerMessage` (fedlt/v1/layer.proto).

A layer that declares its messages as frozen dataclasses adds no Protobuf message, RPC or field: each message
travels as its registered type name and its fields by name, read back against the dataclass's own type hints.
The reading is strict, as everything the aggregator relays is: an unknown type, a missing or unknown field, or
a value of another type than the hint is refused (`WireError`), never coerced. Types carried: bytes, str,
int, float, bool, `tuple[T, ...]`, `Mapping[str, T]` (and dict), nested dataclasses, and `T | None`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from functools import cache

from fedlt.aggregation.halves import BadMessage
from fedlt.v1 import layer_pb2

SCALARS = {
    bytes: "bytes_value",
    str: "string_value",
    int: "int_value",
    float: "float_value",
    bool: "bool_value",
}


class WireError(ValueError):
    """A message or step of a type no implemented layer carries."""


class BadLayerMessage(WireError, BadMessage):
    """A layer message that does not read back as the dataclass its type names: a broken protocol message."""


def entries_of(obj: object) -> layer_pb2.Entries:
    """A dataclass's fields, by name, as `Entries` (a field holding None is left out)."""
    hints = _hints(type(obj))
    entries = layer_pb2.Entries()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            entries.entries[f.name].CopyFrom(_value(value, hints[f.name]))
    return entries


def from_entries(entries: layer_pb2.Entries, cls: type) -> object:
    """The dataclass `cls` from its `Entries`, every field checked against its type hint."""
    hints, fields = _hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(entries.entries) - set(fields))
    if unknown:
        raise BadLayerMessage(f"a {cls.__name__} has no field {unknown[0][:64]!r}")
    values = {}
    for name, f in fields.items():
        if name in entries.entries:
            values[name] = _read(entries.entries[name], hints[name], f"{cls.__name__}.{name}")
        elif not _optional(hints[name]) and f.default is dataclasses.MISSING:
            raise BadLayerMessage(f"a {cls.__name__} without its field {name!r}")
    try:
        return cls(**values)
    except Exception as exc:  # built from what a peer sent: any refusal of it is a bad message
        raise BadLayerMessage(f"a {cls.__name__} that does not hold: {str(exc)[:200]}") from None


def check_carried(cls: type) -> None:
    """Raise WireError if a field of the dataclass `cls` (at any depth) is of a type the codec does not
    carry: a layer is refused when it is installed, not in the middle of a round."""
    for name, hint in _hints(cls).items():
        _check_hint(hint, f"{cls.__name__}.{name}")


def _check_hint(hint: object, where: str) -> None:
    if _is_union(hint):
        rest = [h for h in typing.get_args(hint) if h is not type(None)]
        if len(rest) != 1:
            raise WireError(f"{where}: the generic wire carries T | None, not {hint!r}")
        hint = rest[0]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in SCALARS:
        return
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        _check_hint(args[0], where)
    elif origin in (dict, Mapping, typing.Mapping) and args and args[0] is str:
        _check_hint(args[1], where)
    elif dataclasses.is_dataclass(hint):
        check_carried(hint)
    else:
        raise WireError(f"{where}: the generic wire carries no {hint!r}")


def encode(message: object, type_name: str) -> layer_pb2.LayerMessage:
    return layer_pb2.LayerMessage(type=type_name, fields=entries_of(message))


def decode(message: layer_pb2.LayerMessage, types_by_name: Mapping[str, type]) -> object:
    """The message, if its type is one of `types_by_name` (the registered layers' messages)."""
    cls = types_by_name.get(message.type)
    if cls is None:
        raise BadLayerMessage(f"no layer carries a message of type {message.type[:64]!r}")
    return from_entries(message.fields, cls)


@cache
def _hints(cls: type) -> dict[str, object]:
    if not dataclasses.is_dataclass(cls):
        raise WireError(f"{cls.__name__} is no dataclass: the generic wire carries dataclasses only")
    return typing.get_type_hints(cls)


def _optional(hint: object) -> bool:
    return type(None) in typing.get_args(hint) and _is_union(hint)


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _value(value: object, hint: object) -> layer_pb2.Value:
    if _is_union(hint):
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in SCALARS:
        if type(value) is not hint and not (hint is float and type(value) is int):
            raise WireError(f"a {type(value).__name__} where the message declares {hint.__name__}")
        return layer_pb2.Value(**{SCALARS[hint]: value})
    if origin is tuple:
        return layer_pb2.Value(list_value=layer_pb2.Values(values=[_value(v, args[0]) for v in value]))
    if origin in (dict, Mapping, typing.Mapping):
        entries = layer_pb2.Entries()
        for key, item in value.items():
            entries.entries[key].CopyFrom(_value(item, args[1]))
        return layer_pb2.Value(entries_value=entries)
    if dataclasses.is_dataclass(hint):
        return layer_pb2.Value(entries_value=entries_of(value))
    raise WireError(f"the generic wire carries no {hint!r}")


def _read(value: layer_pb2.Value, hint: object, where: str) -> object:
    if _is_union(hint):
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    kind = value.WhichOneof("kind")
    if hint in SCALARS:
        if kind != SCALARS[hint]:
            raise BadLayerMessage(f"{where}: {kind or 'nothing'} where a {hint.__name__} belongs")
        return getattr(value, kind)
    if origin is tuple:
        if kind != "list_value" or len(args) != 2 or args[1] is not Ellipsis:
            raise BadLayerMessage(f"{where}: {kind or 'nothing'} where a list belongs")
        return tuple(_read(v, args[0], where) for v in value.list_value.values)
    if origin in (dict, Mapping, typing.Mapping):
        if kind != "entries_value":
            raise BadLayerMessage(f"{where}: {kind or 'nothing'} where a mapping belongs")
        return {k: _read(v, args[1], f"{where}[{k[:64]!r}]") for k, v in value.entries_value.entries.items()}
    if dataclasses.is_dataclass(hint):
        if kind != "entries_value":
            raise BadLayerMessage(f"{where}: {kind or 'nothing'} where a {hint.__name__} belongs")
        return from_entries(value.entries_value, hint)
    raise WireError(f"the generic wire carries no {hint!r}")
