"""The `[method]` table of a configuration: a method's name plus that method's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedlt.config import as_table, parse_section
from fedlt.methods.balanced import Balanced
from fedlt.methods.base import Method
from fedlt.methods.ccvr import CCVR
from fedlt.methods.creff import CReFF
from fedlt.methods.dflfs import DFLFS
from fedlt.methods.fedavg import FedAvg
from fedlt.methods.fedprox import FedProx
from fedlt.methods.redgrape import RedGrape
from fedlt.methods.sfd import SFD

METHODS: dict[str, type[Method]] = {
    m.name: m for m in (FedAvg, FedProx, CCVR, CReFF, RedGrape, SFD, DFLFS, Balanced)
}


@dataclass(frozen=True)
class MethodChoice:
    """`name` plus that method's settings, checked against the method's `Options`."""

    name: str = "fedavg"
    options: Any = field(default_factory=METHODS["fedavg"].Options)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, problems: list[str]) -> MethodChoice:
        settings = dict(table)
        name = settings.pop("name", "fedavg")
        if name not in METHODS:
            problems.append(f"{where}.name: unknown method {name!r}; allowed: {', '.join(METHODS)}")
            return cls()
        return cls(name, parse_section(METHODS[name].Options, settings, where, problems))

    def to_table(self) -> dict[str, Any]:
        return {"name": self.name, **as_table(self.options)}
