"""A round's sums over any privacy layer, both sides: the phase's census when one is due, the tail guard, then
the contribution. Written once, used by the simulator (in one process) and the consortium (over gRPC).

Per phase with per-class fields and the tail guard on (`k_min` ≥ 2), the first round's sums start with a
census of its silos (`tail_guard`): the silos it counts are the phase's census set. Every silo then zeroes, in
every per-class field, the classes fewer than k_min of them hold, and every per-class row at all unless the
round's silos are exactly the census set. If per-class rows went out, a silo releases its contribution only
for the whole census set (`SiloRound.may_release`, which each layer's silo half asks at its point of release).

Under differential privacy (a silo with `noise`) per-class rows are noised instead of guarded: the silo claims
every class in the census, so the census says nothing about its records and zeroes no class, and it adds its
share of noise to its contribution, calibrated for the fewest silos the sum can count.

A silo keeps the census it took (`on_census`) with whether it could check it: only a census it computed
itself without DP is one. Under DP every silo claims every class, so the sum reads "every class everywhere"
whatever the silos hold, and under plaintext the silo takes the aggregator's reading; a round that hides
inputs without DP must never guard with either (`silo.participation`), or any other study's round could lift
its tail guard.

Every half a silo runs is made through its release gate (`gate.ReleaseGate`: roster, floors, ledger), which
also has the last word wherever the half releases the silo's input.

Messages travel as (purpose, message) pairs: `purpose` names the sum, "census" or "contribution".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.aggregation import tail_guard
from fedlt.aggregation.gate import ReleaseGate, Subject
from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    Released,
    ReleaseNoise,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
    census_schema,
)
from fedlt.aggregation.schema import Schema
from fedlt.aggregation.tail_guard import Census, CensusError

log = logging.getLogger(__name__)

Outgoing = list[tuple[str, object]]  # (purpose, message)


@dataclass(frozen=True)
class CensusResult:
    """After the census: its sum as the aggregator read it, how many of the counted silos hold each class and
    (with a record floor) their capped records (`Census.vector`); None when only silos can read it."""

    counts: tuple[int, ...] | None


@dataclass(frozen=True)
class RoundSums:
    """What both sides of a round's sums agree on, all of it from the signed RoundSpec."""

    round_id: str
    participants: tuple[str, ...]  # sorted
    schema: Schema
    k_min: int
    census: Census | None  # the phase's census, when an earlier round took it
    binding: bytes = field(default=b"", repr=False)  # the RoundSpec's hash
    settings: object = None  # the layer's parameters, as signed
    record_floor: int = 0  # with the guard on: rows that invert also need this many records (below 2: none)

    @property
    def guarded(self) -> bool:
        return bool(self.schema.classes) and self.k_min >= 2

    @property
    def census_due(self) -> bool:
        return self.guarded and self.census is None

    def census_spec(self) -> SumSpec:
        return SumSpec(
            self.round_id,
            "census",
            self.participants,
            census_schema(self.schema.classes, self.record_floor),
            self.binding,
            self.settings,
        )

    def contribution_spec(self, silos: Sequence[str], census: Census | None) -> SumSpec:
        """The contribution binds the census its guard used too, so every silo guards with the same one (where
        the aggregator read it: `SiloRound.binds_census`)."""
        binding = census.binding(self.binding) if self.guarded and census is not None else self.binding
        return SumSpec(
            self.round_id, "contribution", tuple(sorted(silos)), self.schema, binding, self.settings
        )


# --- a silo -------------------------------------------------------------------------------------------------


class SiloRound:
    """One silo's sums of one round, every half made and every release decided through `gate`.
    `trained_from` is what the contribution was computed from (the starting state's content), the ledger's
    key for it; `records` this silo's record count per class, for the census's record floor (None: the
    fewest its presence allows); `on_census` keeps a census this silo took part in, with whether this silo
    checked it (computed it itself, without DP); `class_names` the plan's names of the classes (None: the
    simulator's one plan), by which the census is keyed."""

    def __init__(
        self,
        side: SiloSide,
        sums: RoundSums,
        contribution: torch.Tensor,
        *,
        me: str,
        gate: ReleaseGate,
        trained_from: Subject,
        records: np.ndarray | None = None,
        on_census: Callable[[Census, bool], None] = lambda _census, _checked: None,
        noise: ReleaseNoise | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        self.side, self.sums, self.me = side, sums, me
        self.class_names = class_names
        self.contribution, self.records = contribution, records
        self.noise = noise
        self.gate, self.trained_from = gate, trained_from
        self.on_census = on_census
        self.census = sums.census
        self.purpose = ""
        self.spec: SumSpec | None = None  # of the open sum
        self.half: SiloHalf | None = None
        self.whole: frozenset[str] = frozenset()  # per-class rows went out: release only for exactly these
        # whether the contribution binds the census: not where only silos read it (ckks, blind), as the
        # aggregator could not derive the binding; there the layer's own consistency step (a signed
        # ciphertext, a signed transcript) already gives every silo the same census
        self.binds_census = True

    @property
    def done(self) -> bool:
        return self.purpose == "contribution" and self.half is not None and self.half.done

    @property
    def result(self) -> torch.Tensor | None:
        return self.half.result if self.done else None

    def start(self) -> Outgoing:
        if self.sums.census_due:
            spec = self.sums.census_spec()
            self.gate.admit(spec, self.side)
            return self._begin(spec, torch.from_numpy(self.census_input().astype(np.float64)))
        return self._begin_contribution(self.sums.participants)

    def step(self, purpose: str, step: object) -> Outgoing:
        if isinstance(step, CensusResult):
            if self.purpose != "census" or self.half is None:
                raise SumAborted("a census result arrived, but this silo took no census")
            return self._after_census(step)
        if purpose != self.purpose or self.half is None:
            raise SumAborted(f"a {purpose} step arrived during the {self.purpose or 'no'} sum")
        outgoing = [(purpose, m) for m in self.half.step(step)]
        if purpose == "census" and self.half.done and self.half.result is not None:
            # kept at once: the aggregator may stop before it sends the result it read
            self._keep_census(np.rint(self.half.result.numpy()).astype(np.uint64), computed=True)
        return outgoing

    @property
    def census_subject(self) -> Subject:
        """What this silo's census gives away, for its ledger: the names of the classes it holds, so that it
        gives them to one set of silos whatever a plan does to the census vector (another class order, a class
        nobody holds, another record floor: each once made a new key, and with it a census, and the per-class
        rows released over it, over another set; found in review). Without names, the vector sent."""
        if self.class_names is None:
            return Subject("census", self.census_input().astype("<u8").tobytes())
        held = sorted(self.class_names[c] for c in np.flatnonzero(self.presence()))
        return Subject("census", json.dumps(held).encode())

    def census_input(self) -> np.ndarray:
        """Presence flags and, with a record floor, capped record counts; under DP every class at the floor,
        so the census is no release."""
        classes, floor = self.sums.schema.classes, self.sums.record_floor
        if not classes:  # no per-class field: no census
            return np.zeros(0, dtype=np.uint64)
        if self.noise is not None:
            return tail_guard.census_input(np.ones(classes), np.full(classes, floor), floor)
        return tail_guard.census_input(self.presence(), self.records, floor)

    def may_release(self, survivors: tuple[str, ...]) -> None:
        """Asked by the layer's silo half where its input becomes releasable: per-class rows leave only in a
        sum over the whole census set, and the gate has the last word."""
        if self.purpose == "contribution" and self.whole and set(survivors) != self.whole:
            raise SumAborted(
                "per-class rows (summed only over the whole census set) or held-out counts (only over every "
                f"silo of the roster) went in, and some of those silos left: "
                f"{', '.join(sorted(self.whole - set(survivors)))}"
            )
        if self.purpose == "census":  # under DP every flag is 1: a census that says nothing of the records
            subject = None if self.noise is not None else self.census_subject
        else:
            subject = self.trained_from
        self.gate.release(self.spec, self.side, survivors, subject)

    def _begin(self, spec: SumSpec, vector: torch.Tensor) -> Outgoing:
        """This silo's half of `spec`, which the gate admitted."""
        self.purpose, self.spec = spec.purpose, spec
        self.half = self.side.half(spec, self.me, may_release=self.may_release)
        return [(spec.purpose, m) for m in self.half.start(vector)]

    def _begin_contribution(self, silos: Sequence[str]) -> Outgoing:
        vector = self._whole_roster_only(silos, self.contribution)
        if self.sums.guarded:
            census = self.census
            if census is None or self.me not in census.silos:
                zeroed, floored = list(range(self.sums.schema.classes)), []
            else:
                zeroed = census.guarded(silos, self.sums.k_min)
                floored = census.floored(self.sums.record_floor)
            if len(zeroed) < self.sums.schema.classes:
                self.whole = frozenset(silos)
            if zeroed or floored:
                log.info(
                    "%s: tail guard zeroes classes %s, and in fields that invert %s",
                    self.sums.round_id,
                    zeroed,
                    floored,
                )
            vector = tail_guard.zero_classes(self.sums.schema, vector, zeroed, inverting=floored)
        spec = self.sums.contribution_spec(silos, self.census if self.binds_census else None)
        self.gate.admit(spec, self.side)  # before any noise is charged to the silo's ledger
        if self.noise is not None:
            counted = len(spec.silos) if self.whole else self.gate.min_counted(spec, self.side)
            vector = self.noise.noised(spec, vector, counted=counted)
        return self._begin(spec, vector)

    def _whole_roster_only(self, silos: Sequence[str], vector: torch.Tensor) -> torch.Tensor:
        """`vector` with its `whole_roster` fields (held-out counts) zeroed unless the sum lists every silo of
        this silo's roster; if they go out, the contribution is released only for exactly those silos."""
        fields = [f for f in self.sums.schema.fields if f.whole_roster]
        if not fields:
            return vector
        if set(silos) == set(self.gate.members()):
            self.whole = frozenset(silos)
            return vector
        log.info("%s: held-out counts stay home: not every silo of the roster is in it", self.sums.round_id)
        schema = self.sums.schema
        out = vector.clone()
        for f, part in zip(schema.fields, torch.split(out, [f.size for f in schema.fields]), strict=True):
            if f.whole_roster:
                part.zero_()
        return out

    def presence(self) -> np.ndarray:
        """The classes this silo's contribution says something about."""
        return tail_guard.presence(self.sums.schema, self.contribution)

    def _after_census(self, result: CensusResult) -> Outgoing:
        """Start the contribution among the silos the census counted, with the census this silo computed
        itself (a layer that hides inputs must let it: the count would be the aggregator's word alone); only
        where the aggregator sees every input anyway (plaintext) is its reading taken."""
        reported = None if result.counts is None else np.asarray(result.counts, dtype=np.uint64)
        if self.census is None or self.census.silos != self.half.counted:
            if self.side.hides_inputs or reported is None:
                raise CensusError("this silo computed no census of its own, and takes no count on trust")
            self._keep_census(reported, computed=False)
        if reported is not None and tuple(int(v) for v in reported) != self.census.vector():
            raise CensusError("the census the aggregator reports is not the sum this silo computed")
        self.binds_census = reported is not None
        return self._begin_contribution(self.census.silos)

    def _keep_census(self, counts: np.ndarray, *, computed: bool) -> None:
        """Check the census sum as far as a silo can, and keep it (`on_census`) before anything else, as
        checked only if this silo `computed` it and claimed no more than it holds (no DP)."""
        survivors = self.half.counted
        tail_guard.check_census(counts, self.census_input(), len(survivors), self.sums.record_floor)
        self.census = Census.from_sum(survivors, counts, self.sums.schema.classes)
        self.on_census(self.census, computed and self.noise is None)
        log.info(
            "%s: census of %d silos taken; classes held by fewer than %d silos or %d records: %s",
            self.sums.round_id,
            len(survivors),
            self.sums.k_min,
            self.sums.record_floor,
            self.census.guarded(survivors, self.sums.k_min) + self.census.floored(self.sums.record_floor),
        )


# --- the aggregator -----------------------------------------------------------------------------------------


class AggregatorRound:
    """The aggregator's part in a round's sums; `min_contributors` is the consortium's floor for a round."""

    def __init__(self, side: AggregatorSide, sums: RoundSums, *, min_contributors: int = 1) -> None:
        self.side, self.sums = side, sums
        self.min_contributors = min_contributors
        self.census = sums.census
        self.census_taken: Census | None = None  # a census this round took, for the caller to keep
        self.zeroed: list[int] = []  # classes zeroed in every per-class field
        self.floored: list[int] = []  # classes below the record floor, zeroed in the fields that invert
        self.whole: tuple[str, ...] = ()
        self.released: dict[str, AggregatorHalf] = {}  # sums this round has moved past, by purpose
        first = sums.census_spec() if sums.census_due else self._contribution_spec(sums.participants)
        self.half: AggregatorHalf = side.half(first)

    @property
    def purpose(self) -> str:
        return self.half.spec.purpose

    @property
    def first(self) -> bool:
        """Whether the open sum is the round's first (its first stage waits for training)."""
        return self.purpose == "census" or not self.sums.census_due

    def receive(self, silo: str, purpose: str, message: object) -> None:
        self._check_purpose(purpose)
        self.half.receive(silo, message)

    def upload_bytes(self, silo: str, purpose: str, kind: type) -> int:
        self._check_purpose(purpose)
        return self.half.upload_bytes(silo, kind)

    def download(self, silo: str, purpose: str) -> bytes:
        """What a silo fetches of this round's sums: of the open one, or of the census it has moved past (the
        last stage of a CKKS sum waits for no one, so silos fetch its result after the census closed)."""
        if purpose in self.released:
            return self.released[purpose].download(silo)
        self._check_purpose(purpose)
        return self.half.download(silo)

    def _check_purpose(self, purpose: str) -> None:
        if purpose != self.purpose:
            raise SumAborted(f"{self.sums.round_id} is running its {self.purpose} sum, not the {purpose} one")

    def close(self) -> list[tuple[str, str, object]] | Released:
        """End the open sum's stage: (silo, purpose, step) to send, or the released contribution sum."""
        out = self.half.close()
        if isinstance(out, Released):
            return self._released(out)
        counted = self.half.counted
        left = len(counted if counted is not None else out)
        if left < self.min_contributors:
            # now, before silos sign for (and so pin: silo.releases) a survivor set the round would not commit
            raise SumAborted(
                f"{self.purpose} sum: {left} silos left, fewer than the {self.min_contributors} the round "
                "needs"
            )
        if self.whole and counted is not None and counted != self.whole:
            gone = ", ".join(sorted(set(self.whole) - set(counted)))
            raise SumAborted(
                f"{gone} left a sum of per-class rows, which silos release only to the whole census"
            )
        return [(silo, self.purpose, step) for silo, step in out.items()]

    def _released(self, released: Released) -> list[tuple[str, str, object]] | Released:
        if self.purpose == "contribution":
            if len(released.survivors) < self.min_contributors:
                raise SumAborted(f"{len(released.survivors)} contributions, fewer than the round needs")
            return released
        counts = (
            None if released.total is None else tuple(int(c) for c in torch.round(released.total).tolist())
        )
        if counts is not None:
            census = Census.from_sum(released.survivors, counts, self.sums.schema.classes)
            self.census_taken = self.census = census
        silos = list(released.survivors)
        self.released[self.purpose] = self.half
        self.half = self.side.half(self._contribution_spec(silos, self.census))
        return [(silo, "census", CensusResult(counts)) for silo in silos]

    def _contribution_spec(self, silos: Sequence[str], census: Census | None = None) -> SumSpec:
        census = census or self.census
        if self.sums.guarded and census is not None:
            self.whole = census.silos if tuple(sorted(silos)) == census.silos else ()
            self.zeroed = census.guarded(silos, self.sums.k_min)
            self.floored = census.floored(self.sums.record_floor)
        return self.sums.contribution_spec(silos, census)
