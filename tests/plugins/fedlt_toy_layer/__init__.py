"""A toy privacy layer, `toy`: additive shares relayed through the aggregator. It exists to prove that a
layer is one package and one registry line (its entry point, in the dist-info beside it): the tests run it
through the simulator and a real consortium with no edit in `silo/`, `aggregator/` or `fedlt/`.

NOT SECURE: the aggregator relays every share in the clear, so it can add them up per silo. A real layer
seals each share to its recipient (as secagg's envelopes do).

Stages: each silo encodes its vector in fixed point (each field's `frac_bits`, in Z_2^64) and splits it into
one random share per silo of the sum, keeping its own (`Shares`, an upload); the aggregator hands each silo
the shares addressed to it (`Inbox`, with the silos that sent shares); each silo adds its own share to them
and sends the partial sum (`Partial`); the aggregator adds the partials and decodes the total. A silo that
sent shares but no partial ends the sum (no recovery: a toy).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.aggregation.halves import (
    AggregatorHalf,
    AggregatorSide,
    BadMessage,
    PartyKeys,
    Released,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
    WrongStage,
)
from fedlt.aggregation.registry import LayerRecord
from fedlt.aggregation.sums import SumLayer
from fedlt.aggregation.tail_guard import GuardSettings

SHARES, PARTIALS, DONE = "shares", "partials", "done"


@dataclass(frozen=True)
class ToySettings(GuardSettings):
    """The tail guard's settings (k_min, min_records) and nothing of its own."""

    def problems(self) -> list[str]:
        return []

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        return []

    def describe(self) -> str:
        return f"toy — additive shares relayed in the clear (tests only), tail guard k_min {self.k_min}"


@dataclass(frozen=True)
class Shares:
    """One silo's shares, by recipient (its own kept back)."""

    by_recipient: Mapping[str, bytes] = field(repr=False)


@dataclass(frozen=True)
class Inbox:
    """The shares addressed to one silo, by sender, and every silo that sent shares."""

    senders: tuple[str, ...]
    by_sender: Mapping[str, bytes] = field(repr=False)


@dataclass(frozen=True)
class Partial:
    """One silo's partial sum: its own share plus the shares it received."""

    total: bytes = field(repr=False)


def _encode(spec: SumSpec, vector: torch.Tensor) -> np.ndarray:
    grids = np.concatenate([np.full(f.size, 2.0**f.frac_bits) for f in spec.schema.fields])
    return np.round(vector.numpy() * grids).astype(np.int64).view(np.uint64)


def _decode(spec: SumSpec, ring: np.ndarray) -> torch.Tensor:
    grids = np.concatenate([np.full(f.size, 2.0**f.frac_bits) for f in spec.schema.fields])
    return torch.from_numpy(ring.view(np.int64).astype(np.float64) / grids)


def _ring(raw: bytes, size: int) -> np.ndarray:
    if len(raw) != 8 * size:
        raise BadMessage(f"a share of {len(raw)} bytes; the sum has {size} values")
    return np.frombuffer(raw, dtype="<u8").copy()


class ToySiloHalf(SiloHalf):
    def __init__(self, spec: SumSpec, me: str, may_release: Callable[[tuple[str, ...]], None]) -> None:
        self.spec, self.me, self._may_release = spec, me, may_release
        self._kept: np.ndarray | None = None
        self._counted: tuple[str, ...] = ()

    def start(self, vector: torch.Tensor) -> list[object]:
        encoded, size = _encode(self.spec, vector.to(torch.float64)), self.spec.schema.size
        shares = {}
        for other in self.spec.silos:
            if other != self.me:
                share = np.frombuffer(secrets.token_bytes(8 * size), dtype="<u8")
                shares[other] = share.tobytes()
                encoded = encoded - share  # uint64 arithmetic wraps: shares add up to the input
        self._kept = encoded
        return [Shares(shares)]

    def step(self, step: object) -> list[object]:
        if not isinstance(step, Inbox) or self._kept is None or self._counted:
            raise WrongStage(f"{type(step).__name__} is no step of this toy sum now")
        senders = step.senders
        if (
            senders != tuple(sorted(set(senders)))
            or self.me not in senders
            or set(step.by_sender) != set(senders) - {self.me}
        ):
            raise BadMessage("an inbox that does not list each sender's share once")
        self._may_release(senders)
        total = self._kept.copy()
        for raw in step.by_sender.values():
            total += _ring(raw, self.spec.schema.size)
        self._counted = senders
        return [Partial(total.astype("<u8").tobytes())]

    @property
    def done(self) -> bool:
        return bool(self._counted)

    @property
    def counted(self) -> tuple[str, ...]:
        return self._counted


class ToyAggregatorHalf(AggregatorHalf):
    def __init__(self, spec: SumSpec) -> None:
        self.spec = spec
        self._stage = SHARES
        self._shares: dict[str, Shares] = {}
        self._partials: dict[str, bytes] = {}
        self._senders: tuple[str, ...] = ()

    @property
    def stage(self) -> str:
        return self._stage

    @property
    def expected(self) -> tuple[str, ...]:
        return {SHARES: self.spec.silos, PARTIALS: self._senders}.get(self._stage, ())

    @property
    def answered(self) -> set[str]:
        return {SHARES: set(self._shares), PARTIALS: set(self._partials)}.get(self._stage, set())

    def receive(self, silo: str, message: object) -> None:
        if silo not in self.expected:
            raise WrongStage(f"{silo} sends nothing to this sum at {self._stage}")
        if self._stage == SHARES and isinstance(message, Shares):
            if set(message.by_recipient) != set(self.spec.silos) - {silo}:
                raise BadMessage(f"{silo}'s shares are not one for each other silo of the sum")
            self._shares.setdefault(silo, message)
        elif self._stage == PARTIALS and isinstance(message, Partial):
            _ring(message.total, self.spec.schema.size)
            self._partials.setdefault(silo, message.total)
        else:
            raise WrongStage(f"a {type(message).__name__} does not belong to the {self._stage} stage")

    def close(self) -> Mapping[str, object] | Released:
        if self._stage == SHARES:
            self._senders = tuple(u for u in self.spec.silos if u in self._shares)
            if not self._senders:
                raise SumAborted("no silo sent shares")
            self._stage = PARTIALS
            return {
                v: Inbox(self._senders, {u: self._shares[u].by_recipient[v] for u in self._senders if u != v})
                for v in self._senders
            }
        silent = sorted(set(self._senders) - set(self._partials))
        if silent:
            raise SumAborted(
                f"{', '.join(silent)} sent shares but no partial sum: the toy layer cannot recover"
            )
        total = np.zeros(self.spec.schema.size, dtype=np.uint64)
        for u in self._senders:
            total += _ring(self._partials[u], self.spec.schema.size)
        self._stage = DONE
        return Released(self._senders, _decode(self.spec, total))

    def upload_bytes(self, silo: str, kind: type) -> int:
        if kind is not Shares or self._stage != SHARES:
            raise WrongStage(f"this sum takes shares at its first stage, not a {kind.__name__}")
        per_share = 8 * self.spec.schema.size + 64  # the bytes, a silo id and the codec's framing
        return len(self.spec.silos) * per_share + 64


class ToySiloSide(SiloSide):
    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf:
        return ToySiloHalf(spec, me, may_release)


class ToyAggregatorSide(AggregatorSide):
    def half(self, spec: SumSpec) -> AggregatorHalf:
        return ToyAggregatorHalf(spec)


class ToySum(SumLayer):
    name = "toy"

    def __init__(self, settings: ToySettings | None = None) -> None:
        super().__init__()
        self.settings = settings or ToySettings()

    def describe(self) -> str:
        return self.settings.describe()

    def silo_side(self, keys: PartyKeys) -> SiloSide:
        return ToySiloSide()

    def aggregator_side(self, keys: PartyKeys) -> AggregatorSide:
        return ToyAggregatorSide()

    def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
        return dict.fromkeys(silos, ToySiloSide()), ToyAggregatorSide()


LAYER = LayerRecord(
    name="toy", layer=ToySum, settings=ToySettings, messages=(Shares, Inbox, Partial), uploads=(Shares,)
)
