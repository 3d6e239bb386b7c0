"""A privacy layer's two halves, driven stage by stage with the transport left out.

One **sum** of one round (the census, or the contribution) is a `SumSpec`: which silos, what is summed (a
schema), and what every party binds its messages to. Each silo runs a `SiloHalf`: it turns its vector into the
messages it sends and checks what it receives. The aggregator runs an `AggregatorHalf`: it takes one message
per expected silo and stage, and each `close` ends a stage, returning what goes to each silo next, or
`Released` when the sum is done. Messages are the layer's own Python objects; a transport carries them (in one
process for the simulator, gRPC with the layer's wire module in the consortium), as Google's FCP keeps
protocol state apart from transport. Which half a layer makes, and with which keys, is the layer's business
(`SiloSide`, `AggregatorSide`); the round driver (`round_sums`) and the round engine never look at a layer's
name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from fedlt.aggregation.schema import Field, Schema
from fedlt.errors import FedltError

PURPOSES = ("census", "contribution", "evaluation")


class SumAborted(FedltError):
    """The sum cannot be completed (too few silos left, a broken message); no partial sum is ever released."""


class SettingsRefused(FedltError):
    """Settings under which no attempt can succeed (a fixed-point range that could overflow): retrying the
    round cannot help, the operator must change them."""


class BadMessage(SumAborted):
    """A message that breaks the layer's protocol: forged, malformed, misaddressed, inconsistent."""


class WrongStage(SumAborted):
    """A message for a stage that is not the current one, or from a silo not expected to send it."""


@dataclass(frozen=True)
class SumSpec:
    """One sum of one round, as every party derives it from the signed RoundSpec."""

    round_id: str
    purpose: str
    silos: tuple[str, ...]  # who may take part, sorted
    schema: Schema  # what is summed, flattened in field order
    binding: bytes = field(default=b"", repr=False)  # what the parties bind their messages to
    settings: object = None  # the layer's parameters for this round, as signed (secagg: threshold, graph)

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise SumAborted(f"unknown purpose {self.purpose!r}; known: {', '.join(PURPOSES)}")
        if tuple(sorted(set(self.silos))) != self.silos:
            raise SumAborted("a sum's silos are distinct and sorted")


def census_schema(classes: int, record_floor: int = 1) -> Schema:
    """The census sums one 0/1 presence flag per class and silo, and with a record floor each silo's record
    count of the class capped at the floor (`tail_guard.census_input`): exact integers in every layer."""
    present = Field("present", (classes,), 1.0, "1 for each class the silo holds", frac_bits=0)
    if record_floor <= 1:
        return Schema((present,))
    records = Field(
        "records", (classes,), float(record_floor), "records of each class, capped at the floor", frac_bits=0
    )
    return Schema((present, records))


EVALUATION_PHASE = "evaluation"
EVALUATION_BOUND = float(2**30)  # a silo's test counts of one class, plus its share of zero-sum masks


def evaluation_fields(classes: int, *, records: bool = False) -> tuple[Field, ...]:
    """A held-out evaluation as per-class counts, summed over silos: test samples predicted right and test
    samples, neither per class for the tail guard nor noised (held-out records are not training records,
    and a count of them says nothing of the records the model learnt from), released only in sums over every
    silo of the roster (`Field.whole_roster`). With `records`, also each silo's
    training records per class as it may report them (exact, or under DP noised once per run, so no further
    noise): per class, so the tail guard zeroes the classes fewer than k_min silos hold, as it would any
    per-class count."""
    fields = (
        Field(
            "evaluation.correct",
            (classes,),
            EVALUATION_BOUND,
            "test samples of the class predicted right",
            frac_bits=0,
            whole_roster=True,
        ),
        Field(
            "evaluation.total",
            (classes,),
            EVALUATION_BOUND,
            "test samples of the class",
            frac_bits=0,
            whole_roster=True,
        ),
    )
    if not records:
        return fields
    reported = Field(
        "evaluation.records",
        (classes,),
        EVALUATION_BOUND,
        "training records of the class, as the silo reports them",
        frac_bits=0,
        per_class=True,
    )
    return (*fields, reported)


def evaluation_schema(classes: int) -> Schema:
    """The evaluation counts alone: the sum silos add where only they hold the model (ckks), and the round
    after the last one where the aggregator steps it (`evaluation_block`)."""
    return Schema(evaluation_fields(classes), phase=EVALUATION_PHASE)


@dataclass(frozen=True)
class Released:
    """The end of a sum: who was summed, and the sum if the aggregator may see it (None if only silos do)."""

    survivors: tuple[str, ...]
    total: torch.Tensor | None
    # where only silos read the sum, those that did, and so step the model (None: every survivor); under
    # blind a silo lost after its masked input is counted (its input is in the sum) but handed nothing
    readers: tuple[str, ...] | None = None

    @property
    def stepping(self) -> tuple[str, ...]:
        """The silos that step the model from this sum, where silos do."""
        return self.survivors if self.readers is None else self.readers


class SiloHalf(ABC):
    """One silo's part in one sum. `start` and `step` return the messages to send, in order."""

    @abstractmethod
    def start(self, vector: torch.Tensor) -> list[object]:
        """Begin with this silo's float64 vector (flattened in the spec's schema)."""

    @abstractmethod
    def step(self, step: object) -> list[object]:
        """Act on one of the aggregator's stage outputs; raise (a FedltError) to leave the sum."""

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether this silo has nothing more to send or receive in this sum."""

    @property
    @abstractmethod
    def counted(self) -> tuple[str, ...]:
        """The silos whose inputs this sum counts, once this silo knows them (empty before)."""

    @property
    def result(self) -> torch.Tensor | None:
        """The sum, for layers that release it to the silos rather than the aggregator."""
        return None

    @property
    def readers(self) -> tuple[str, ...]:
        """Where silos read the sum: those that do, and so step the model and sign the state (by default
        every counted silo; `Released.readers`)."""
        return self.counted


class AggregatorHalf(ABC):
    """The aggregator's part in one sum: one message per expected silo and stage, then `close`."""

    spec: SumSpec

    @property
    @abstractmethod
    def stage(self) -> str: ...

    @property
    @abstractmethod
    def expected(self) -> tuple[str, ...]:
        """Who may send a message at the current stage."""

    @property
    @abstractmethod
    def answered(self) -> set[str]:
        """Who has sent their message for the current stage."""

    @abstractmethod
    def receive(self, silo: str, message: object) -> None:
        """One silo's message (its identity from the transport, never from the message); refuse what does
        not belong to this stage with a FedltError."""

    @abstractmethod
    def close(self) -> Mapping[str, object] | Released:
        """End the stage with whoever answered: each silo's next step, or the end of the sum."""

    @property
    def counted(self) -> tuple[str, ...] | None:
        """The silos whose inputs the sum will count, once that is settled (None before)."""
        return None

    @abstractmethod
    def upload_bytes(self, silo: str, kind: type) -> int:
        """The most bytes a silo's upload of message type `kind` may take now (the transport refuses a larger
        announced size before reading a byte; the half checks the exact size it needs); raise if no such
        upload is due."""

    def download(self, silo: str) -> bytes:
        """What a silo fetches at this stage (a CKKS sum); most layers have nothing to fetch."""
        raise WrongStage(f"the {self.stage!r} stage of this sum has nothing to download")


class Signer(Protocol):
    """How a party signs: its certificate's key, over `data` under a domain-separating `context`."""

    def __call__(self, data: bytes, *, context: str) -> bytes: ...


class Peers(Protocol):
    """Checks that `signature` over `data` was made by silo `silo`, whose credential is `credential`."""

    def verify(
        self, silo: str, credential: bytes, signature: bytes, data: bytes, *, context: str
    ) -> None: ...


PolicyT = TypeVar("PolicyT")
SecretT = TypeVar("SecretT")


@dataclass(frozen=True)
class PartyKeys(Generic[PolicyT, SecretT]):
    """What a consortium party brings to any layer's side: how it signs, how it checks other members'
    signatures, (a silo) the layer's reading of its policy (`LayerRecord.policy`), and the layer's key
    material; each layer names the two last types it takes (e.g. `PartyKeys[SessionPolicy, None]`)."""

    sign: Signer | None = None
    peers: Peers | None = None
    policy: PolicyT | None = None
    secret: SecretT | None = None  # e.g. ckks's context: secret at a silo, public at the aggregator


class SiloSide(ABC):
    """A layer as one silo uses it: its keys and checks, ready to make the silo's half of any sum.

    `may_release(silos)` is asked by the half where its input becomes releasable as part of a sum over `silos`
    (secagg: before signing the consistency round); it raises to refuse.
    """

    hides_inputs: bool = True  # False only where the aggregator sees every input anyway (plaintext)
    # True where only silos can read a sum (ckks): they run the server step and keep the state sealed
    steps_model: bool = False

    @abstractmethod
    def half(self, spec: SumSpec, me: str, *, may_release: Callable[[tuple[str, ...]], None]) -> SiloHalf: ...

    def problems(self, spec: SumSpec) -> list[str]:
        """What in this sum's signed parameters this silo's policy refuses (checked before any work)."""
        return []

    def min_counted(self, spec: SumSpec) -> int:
        """The fewest silos whose inputs a completed sum of this layer can count, by its own protocol (secagg:
        its threshold). The silo's release gate raises it to the policy's floor and refuses sums below that,
        and distributed DP noise is calibrated for the result (`gate.ReleaseGate.min_counted`)."""
        return 1


class ReleaseNoise(Protocol):
    """A silo's differential privacy for what it releases in sums (`privacy.dp.SiloPrivacy`)."""

    def noised(self, spec: SumSpec, vector: torch.Tensor, *, counted: int) -> torch.Tensor:
        """`vector` with this silo's share of noise on every field with a sensitivity, for a sum that will
        count at least `counted` silos; the release is in the silo's ledger (or refused) before it returns."""
        ...


class AggregatorSide(ABC):
    """A layer as the aggregator uses it."""

    @abstractmethod
    def half(self, spec: SumSpec) -> AggregatorHalf: ...

    def eligible(self, silo: str) -> bool:
        """Whether `silo` can take part in a sum now (ckks: it has been sent the consortium's key)."""
        return True

    def round_settings(self, settings: object) -> object:
        """The layer's parameters as a RoundSpec signs them (ckks adds the key every silo must use)."""
        return settings
