"""`Sums`, the only thing a method's server half ever receives, and the privacy-layer interface that makes it.

A server step that could see one silo's contribution would void every promise of the toolkit, so a `Sums` can
only be created through `SumLayer.seal` — its constructor refuses a direct call — and `server_step` checks the
type it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import torch

from fedlt.aggregation.schema import Contribution, Schema
from fedlt.errors import ContributionError

_SEAL = object()


class Sums(Mapping[str, torch.Tensor]):
    """Field-wise sums over `contributors` silos, in float64, keyed by the schema's field names."""

    __slots__ = ("_values", "contributors", "schema")

    def __init__(
        self, schema: Schema, vector: torch.Tensor, contributors: int, *, _token: object = None
    ) -> None:
        if _token is not _SEAL:
            raise TypeError("Sums are made only by a privacy layer (SumLayer.seal), never directly")
        self.schema = schema
        self.contributors = contributors
        self._values = schema.unflatten(vector.to(torch.float64))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Sums(phase={self.schema.phase!r}, fields={list(self)}, contributors={self.contributors})"


class SumLayer(ABC):
    """A privacy layer: turns the silos' contributions into their sum and nothing more.

    `plaintext` adds them in the clear (research and tests only); `secagg` and `ckks` implement the same
    interface so the simulator and the consortium run every method unchanged over any of them.
    """

    name: ClassVar[str]

    @abstractmethod
    def aggregate(
        self, schema: Schema, contributions: Sequence[Contribution], *, silos: Sequence[str] = ()
    ) -> Sums:
        """Sum the contributions of one round, or raise; never return a partial sum.

        `silos` names the contributors, in order, for layers that keep track of who was summed (the secure
        layer's census set); without names they are numbered.
        """

    def saved(self) -> dict:
        """What this layer must carry across a resumed run (the secure layer's census per phase)."""
        return {}

    def restore(self, saved: dict) -> None:
        """Take back what `saved` returned; a layer that keeps nothing refuses another layer's memory."""
        if saved:
            raise ContributionError(f"the {self.name!r} layer keeps no memory, but was given {sorted(saved)}")

    @staticmethod
    def seal(schema: Schema, vector: torch.Tensor, contributors: int) -> Sums:
        return Sums(schema, vector, contributors, _token=_SEAL)

    @staticmethod
    def check_round(schema: Schema, contributions: Sequence[Contribution]) -> None:
        if not contributions:
            raise ContributionError("no contributions to aggregate")
        stray = [i for i, c in enumerate(contributions) if c.schema != schema]
        if stray:
            raise ContributionError(f"contributions {stray} were built for another schema or phase")
