"""The keystone interface: a method is a schema, a silo half and a server half that only ever sees sums.

    local_round(state, data, ctx) -> Contribution     on each silo, next to its data
    server_step(state, sums, ctx) -> state            pure and seeded, on whoever holds the sums

The simulator and the consortium call exactly these, over any privacy layer, so a seeded run gives the same
numbers in both. A method may run in phases (CCVR's post-hoc calibration round after training):
`schema(state)` names the coming round's phase and fields, and `remaining_rounds(state)` tells a driver when
to stop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.data.arrays import LabeledData
from fedlt.device import resolve_device
from fedlt.dp import DPSettings
from fedlt.errors import ContributionError
from fedlt.methods import standardise
from fedlt.methods.local import GradHook, PrivateRound, TrainConfig
from fedlt.methods.state import GlobalState
from fedlt.models import ModelOptions, SplitModel, build_model, dp_compatible
from fedlt.models.standardise import standardise_layer, standardising
from fedlt.seeding import derive_seed, torch_generator

if TYPE_CHECKING:
    from fedlt.data.table import TableLayout


@dataclass(frozen=True)
class ModelSpec:
    """`name`: a built-in model or an entry point, with `options` for its factory (`fedlt.models.entry`).
    `input_shape`: one sample's, (C, H, W) or (features,). `table`: the rows are encoded by this layout, and
    the model standardises them first (`fedlt.models.standardise`). `private`: the model trains with DP-SGD,
    so layers that mix a batch's samples are replaced."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    private: bool = False
    options: ModelOptions = field(default_factory=ModelOptions)
    table: TableLayout | None = None

    def build(self, seed: int) -> SplitModel:
        model = build_model(
            self.name,
            input_shape=self.input_shape,
            num_classes=self.num_classes,
            seed=seed,
            options=self.options,
        )
        if self.table is not None:
            model = standardising(model, self.table.numeric, self.table.indicators)
        return dp_compatible(model) if self.private else model


@dataclass(frozen=True)
class SiloContext:
    """Where a silo's randomness comes from: the run seed, its identity and the round, nothing global —
    except under DP (`private`), whose noise and batches come from the silo's own CSPRNG."""

    round: int
    silo_id: str
    seed: int
    private: PrivateRound | None = None

    def generator(self, purpose: str) -> torch.Generator:
        return torch_generator(self.seed, "silo", self.silo_id, self.round, purpose)


def reported_counts(counts: np.ndarray, ctx: SiloContext) -> torch.Tensor:
    """A silo's per-class record counts as it may report them: exact, or under DP noised once per run
    (float64, never negative)."""
    if ctx.private is not None:
        counts = ctx.private.reported_counts(counts)
    return torch.as_tensor(counts, dtype=torch.float64).clamp(min=0)


@dataclass(frozen=True)
class ServerContext:
    round: int
    seed: int


class Method(ABC):
    """`Options` is the dataclass of the method's own settings, the `[method]` table of a config."""

    name: ClassVar[str]
    Options: ClassVar[type]

    def __init__(
        self, *, options: Any, train: TrainConfig, model: ModelSpec, rounds: int, dp: DPSettings | None = None
    ) -> None:
        """`rounds` is the planned number of training rounds; a method with a closing phase (a post-hoc
        statistics round) runs it after them, so it must know when training ends. With `dp` enabled the
        model trains with DP-SGD and every statistic of records is clipped per record and declared with its
        sensitivity, for the silos to noise."""
        if not isinstance(options, self.Options):
            raise TypeError(f"{self.name} takes {self.Options.__name__}, got {type(options).__name__}")
        if rounds < 1:
            raise ValueError(f"a run needs at least one training round, got {rounds}")
        self.options = options
        self.train = train
        self.dp = dp if dp is not None and dp.enabled else None
        self.model_spec = replace(model, private=True) if self.dp else model
        self.rounds = rounds
        self._work: SplitModel | None = None

    @property
    def device(self) -> torch.device:
        """Where this party's silo half computes (`[train] device`, a silo's `[compute] device`); the server
        half stays on the CPU, where every party that steps computes the same state (`fedlt.device`)."""
        return resolve_device(self.train.device, setting="train.device")

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        """The statistics of records the plan releases besides the model change, and in how many rounds:
        a silo under DP budgets their noise before it picks its DP-SGD σ. None by default."""
        return (), 0

    def trained_rounds(self, state: GlobalState) -> int:
        """Training rounds `state` has been through (every round, unless the method has a closing phase,
        less a table study's opening round)."""
        return state.round - int(self._standardiser() is not None and not self.opens(state))

    def remaining_rounds(self, state: GlobalState) -> int:
        """Rounds a driver still runs from `state`: any opening round, the training rounds left, then any
        closing phase.

        Counted from the state rather than from round numbers, so a finished run whose `rounds` grew
        trains on and closes again."""
        return max(self.rounds - self.trained_rounds(state), 0) + int(self.opens(state))

    def trains(self, state: GlobalState) -> bool:
        """Whether the coming round trains: only training rounds pick a subset of silos; an opening or
        closing statistics round wants every silo's data."""
        return not self.opens(state) and self._trains(state)

    def _trains(self, state: GlobalState) -> bool:
        return True

    def opens(self, state: GlobalState) -> bool:
        """Whether the coming round is a table study's opening round (`fedlt.methods.standardise`): the
        model standardises numeric features, and its statistics are not filled yet."""
        prefix = self._standardiser()
        return prefix is not None and not standardise.is_ready(state, prefix)

    def _standardiser(self) -> str | None:
        """The state-dict prefix of the model's Standardise layer, where an opening round fills it: table
        rows with numeric columns, and no DP (under which features keep the schema's scaling)."""
        table = self.model_spec.table
        if self.dp is not None or table is None or not table.numeric:
            return None
        found = standardise_layer(self.working_model())
        return None if found is None else found[0]

    def build_model(self, seed: int) -> SplitModel:
        """The method's network; methods with an extra head (RedGrape) add it here."""
        return self.model_spec.build(seed)

    def network(self, seed: int) -> SplitModel:
        """`build_model`'s network, under DP with the layers Opacus cannot clip per record replaced (extra
        heads included: SFD's projector has BatchNorm too)."""
        model = self.build_model(seed)
        return dp_compatible(model) if self.dp else model

    def init_state(self, *, seed: int) -> GlobalState:
        return GlobalState(0, self.network(derive_seed(seed, "model-init")).state_dict())

    def schema(self, state: GlobalState) -> Schema:
        """The fields of the coming round; may depend on the state (a method's phase)."""
        if self.opens(state):
            return standardise.schema(len(self.model_spec.table.numeric))
        return self._schema(state)

    def local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        """Silo half: train on local data and return what the consortium sums."""
        if self.opens(state):
            table = self.model_spec.table
            moments = standardise.moments(data.x, table.numeric, table.indicators)
            return self.schema(state).contribution(**moments)
        return self._local_round(state, data, ctx)

    @abstractmethod
    def _schema(self, state: GlobalState) -> Schema: ...

    @abstractmethod
    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution: ...

    def server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        """Server half; refuses anything but sums made by a privacy layer for this round's schema."""
        if not isinstance(sums, Sums):
            raise TypeError(f"server_step takes Sums from a privacy layer, got {type(sums).__name__}")
        if sums.schema != self.schema(state):
            raise ContributionError("sums were made for another schema or phase than this round's")
        if self.opens(state):
            return standardise.standardised(state, sums, self._standardiser())
        return self._server_step(state, sums, ctx)

    @abstractmethod
    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState: ...

    def eval_model(self, state: GlobalState) -> SplitModel:
        """The model to evaluate (methods that re-train the head override this)."""
        return self.load(state.model)

    def load(self, weights: Any) -> SplitModel:
        """A working model holding `weights`, reused across calls to avoid rebuilding it every round."""
        model = self.working_model()
        model.load_state_dict(weights)
        return model

    def working_model(self) -> SplitModel:
        if self._work is None:
            self._work = self.network(0)
        return self._work

    @property
    def feature_dim(self) -> int:
        return self.working_model().feature_dim

    def before_step(self, model: SplitModel) -> GradHook | None:
        """A gradient edit applied at every local step; none by default."""
        return None
