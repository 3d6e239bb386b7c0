"""One way to map a dataclass to its Protobuf message and back: field by field, by name.

Messages that have Protobuf forms of their own (the schema every RoundSpec carries, secagg's keys and share
envelopes, the key service's enrollments and envelopes) are dataclasses whose fields match their messages'
by name, or by the renames given once beside the pair; no module copies fields by hand. Every field of the
dataclass must be carried, unless named `local` (a field that never travels, such as a field's doc).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf.message import Message


@dataclass(frozen=True)
class Mapped:
    """The dataclass `cls` as the message `message`; `renamed`: dataclass field -> message field."""

    cls: type
    message: type[Message]
    renamed: Mapping[str, str] = field(default_factory=dict)
    local: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        carried = set(self.message.DESCRIPTOR.fields_by_name)
        lost = [name for name in self._fields() if self._on_wire(name) not in carried]
        if lost:
            raise TypeError(f"{self.message.__name__} carries no field for {self.cls.__name__}.{lost[0]}")

    def _fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.cls) if f.init and f.name not in self.local]

    def _on_wire(self, name: str) -> str:
        return self.renamed.get(name, name)

    def to_pb(self, obj: object) -> Message:
        return self.message(**{self._on_wire(name): getattr(obj, name) for name in self._fields()})

    def from_pb(self, message: Message) -> object:
        wire = self.message.DESCRIPTOR.fields_by_name
        values = {}
        for name in self._fields():
            value = getattr(message, self._on_wire(name))
            values[name] = tuple(value) if wire[self._on_wire(name)].is_repeated else value
        return self.cls(**values)
