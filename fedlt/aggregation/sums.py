"""`Sums`, the only thing a method's server half ever receives, and the privacy-layer interface that makes it.

A server step that could see one silo's contribution would void every promise of the toolkit, so a `Sums` can
only be created through `SumLayer.seal` — its constructor refuses a direct call — and `server_step` checks the
type it is given.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch

from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, Subject
from fedlt.aggregation.halves import AggregatorSide, PartyKeys, Released, ReleaseNoise, SiloSide
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.aggregation.schema import Contribution, Schema
from fedlt.aggregation.tail_guard import Census, guard_of
from fedlt.errors import ContributionError

_SEAL = object()
SIMULATED_FLOORS = Floors(participants=2, survivors=2)  # a sum of one silo is its input, even in one process


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

    Each layer is a pair of halves (`halves`): the simulator runs them here, in one process, through the
    same round driver as the consortium (`round_sums`), so a seeded run gives the same numbers in both.
    `plaintext` adds in the clear (research and tests only); `secagg` and `ckks` hide each silo's input.
    """

    name: ClassVar[str]
    # only silos can read this layer's sums: they run the server step and sum their evaluation counts
    # themselves (their side's `steps_model`), so no evaluation block rides in the contribution
    silos_step: ClassVar[bool] = False
    settings: object = None  # the layer's own parameters, which every sum of a round carries

    def __init__(self) -> None:
        self.censuses: dict[str, Census] = {}  # the simulator's census per phase (a consortium keeps its own)
        self.zeroed: list[int] = []  # the classes the last round's guard zeroed
        self.floored: list[int] = []  # and those it zeroed in the fields that invert (the record floor)
        self.ledgers: dict[str, MemoryLedger] = {}  # each simulated silo's releases, for as long as the run

    @abstractmethod
    def describe(self) -> str:
        """One line for the operator: what the aggregator learns with this layer and these settings."""

    @abstractmethod
    def silo_side(self, keys: PartyKeys) -> SiloSide:
        """This layer as a consortium silo uses it, with the silo's keys and policy."""

    @abstractmethod
    def aggregator_side(self, keys: PartyKeys) -> AggregatorSide:
        """This layer as the consortium's aggregator uses it."""

    @abstractmethod
    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        """Both sides for silos that all live in this process (keys made here, for this run only)."""

    def aggregate(
        self,
        schema: Schema,
        contributions: Sequence[Contribution],
        *,
        silos: Sequence[str] = (),
        noise: Mapping[str, ReleaseNoise] | None = None,
        trained_from: str = "",
        records: Mapping[str, np.ndarray] | None = None,
        class_names: Sequence[str] | None = None,
    ) -> Sums:
        """Sum the contributions of one round, or raise; never return a partial sum.

        `silos` names the contributors, in order; without names they are numbered. Every silo answers every
        stage: the simulator has no dropouts (tests drive the halves themselves for those). `noise` holds
        each silo's differential privacy, under DP. Each silo passes its own release gate, as in a
        consortium, with the floor of two silos (every silo's data is in this process anyway) and a ledger
        kept for the run; `trained_from` names the state the contributions come from (its content digest),
        the ledger's key, or, empty, a state no other call repeats. `records` holds each silo's record count
        per class, for the census's record floor (without it a silo claims the fewest its rows allow);
        `class_names`, the plan's, key each silo's census as an agent keys it (without them, by its vector).
        """
        self.check_round(schema, contributions)
        names = list(silos) or [f"silo-{i:04d}" for i in range(len(contributions))]
        sums = RoundSums(
            round_id=secrets.token_hex(8),
            participants=tuple(sorted(names)),
            schema=schema,
            k_min=self.k_min,
            census=self.censuses.get(schema.phase),
            settings=self.settings,
            record_floor=guard_of(self.settings).min_records,
        )
        silo_sides, aggregator_side = self.in_process(names)
        aggregator = AggregatorRound(aggregator_side, sums)
        vectors = dict(zip(names, (c.flat() for c in contributions), strict=True))
        noise, records = noise or {}, records or {}
        subject = (
            Subject("contribution", trained_from.encode()) if trained_from else Subject.fresh("contribution")
        )
        rounds = {
            u: SiloRound(
                silo_sides[u],
                sums,
                v,
                me=u,
                gate=self._gate(u, names),
                trained_from=subject,
                records=records.get(u),
                noise=noise.get(u),
                class_names=class_names,
            )
            for u, v in vectors.items()
        }
        released = run_round(aggregator, rounds)
        if aggregator.census_taken is not None:
            self.censuses[schema.phase] = aggregator.census_taken
        self.zeroed, self.floored = aggregator.zeroed, aggregator.floored
        total = released.total if released.total is not None else rounds[released.survivors[0]].result
        return self.seal(schema, total, len(released.survivors))

    @property
    def k_min(self) -> int:
        """The tail guard: per-class rows of classes fewer silos hold are zeroed; below 2, off."""
        return guard_of(self.settings).k_min

    def _gate(self, silo: str, names: Sequence[str]) -> ReleaseGate:
        ledger = self.ledgers.setdefault(silo, MemoryLedger())
        return ReleaseGate(
            consortium="simulation", floors=SIMULATED_FLOORS, members=lambda: names, ledger=ledger
        )

    def saved(self) -> dict:
        """What a resumed simulation must carry over: the census of each phase."""
        return {
            p: {"silos": list(c.silos), "counts": list(c.counts), "records": list(c.records)}
            for p, c in self.censuses.items()
        }

    def restore(self, saved: dict) -> None:
        """Take back what `saved` returned."""
        self.censuses = {
            phase: Census.of(c["silos"], c["counts"], c.get("records", ())) for phase, c in saved.items()
        }

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


def run_round(
    aggregator: AggregatorRound,
    silos: Mapping[str, SiloRound],
    relay: Callable[[str, object], object] = lambda _silo, step: step,
) -> Released:
    """A round's sums with every message delivered at once: the simulator's in-process transport. `relay`
    hands each step to its silo as the transport would (an attack's transport forges some)."""
    inbox = [(u, purpose, m) for u, r in silos.items() for purpose, m in r.start()]
    while True:
        for silo, purpose, message in inbox:
            aggregator.receive(silo, purpose, message)
        out = aggregator.close()
        if isinstance(out, Released):
            return out
        inbox = [(u, p, m) for u, purpose, step in out for p, m in silos[u].step(purpose, relay(u, step))]
