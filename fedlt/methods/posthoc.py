"""Methods that train like FedAvg and then fit the evaluated head to pooled per-class feature statistics.

CCVR, SFD and DFL-FS share the shape: R training rounds, then one closing round in which every silo
contributes Σz, Σzzᵀ (upper triangle) and counts per class — plus whatever else the method needs, e.g. SFD's
Σφ(z) — from the final, frozen encoder; the server pools them and fits a head, which the evaluated model
wears on the final backbone. The closing round leaves the model itself unchanged.

Training rounds are counted in the state (`extra["trained"]`), not from round numbers, so a finished run
whose `rounds` grows trains on and closes again.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import placed
from fedlt.errors import ContributionError
from fedlt.methods.base import ServerContext, SiloContext, reported_counts
from fedlt.methods.feature_stats import ClassGaussians, class_sums, upper_size
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.heads import clip_features, extract_features, with_head
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel

CLOSING = "statistics"


@dataclass(frozen=True)
class StatisticsOptions(FedAvgOptions):
    feature_bound: float = setting(100.0, gt=0.0, doc="largest |feature| element a silo reports")


def count_field(classes: int, n_max: float) -> Field:
    """Per class, the silo's record count: exact integers, through the tail guard."""
    return Field("count", (classes,), n_max, "per class sample count", frac_bits=0, per_class=True)


class PostHocHead(FedAvg):
    """FedAvg training, a closing statistics round, and a head fitted to the pooled statistics.

    Under DP each record's feature vector is clipped to `dp.feature_norm` (L2) before the sums, which bounds
    one record's reach: Σz by the norm, the upper triangle of Σzzᵀ by its square; the counts are the silo's
    noised counts, released once per run."""

    def init_state(self, *, seed: int) -> GlobalState:
        state = super().init_state(seed=seed)
        return GlobalState(0, state.model, {"trained": torch.tensor(0)})

    def trained_rounds(self, state: GlobalState) -> int:
        return int(state.extra["trained"])

    def remaining_rounds(self, state: GlobalState) -> int:
        closing = self.closes_after_training() and "head.weight" not in state.extra
        return super().remaining_rounds(state) + int(closing)

    def closes_after_training(self) -> bool:
        """False for a method that fits its head in every training round instead (CCVR's option)."""
        return True

    def closing(self, state: GlobalState) -> bool:
        return self.closes_after_training() and self.trained_rounds(state) >= self.rounds

    def _trains(self, state: GlobalState) -> bool:
        return not self.closing(state)

    def with_statistics(self, state: GlobalState) -> bool:
        return self.closing(state) or not self.closes_after_training()

    def _schema(self, state: GlobalState) -> Schema:
        if self.closing(state):
            return Schema(self.statistics_fields(), phase=CLOSING)
        statistics = self.statistics_fields() if self.with_statistics(state) else ()
        return Schema((*self.model_fields(state), *statistics))

    def statistics_fields(self) -> tuple[Field, ...]:
        classes, dim = self.model_spec.num_classes, self.feature_dim
        n_max, bound = float(self.options.max_silo_samples), self.options.feature_bound
        norm = self.dp.feature_norm if self.dp else 0.0
        return (
            Field(
                "feature_sum", (classes, dim), n_max * bound, "per class Σz", per_class=True, sensitivity=norm
            ),
            Field(
                "outer_sum",
                (classes, upper_size(dim)),
                n_max * bound * bound,
                "per class Σzzᵀ, upper triangle",
                frac_bits=16,
                per_class=True,
                sensitivity=norm**2,
                float64=True,  # the covariance is E[zzᵀ] − μμᵀ: float32 would lose it to cancellation
                inverts=True,  # with Σz and n, two records' worth are both records (attacks.moments)
            ),
            count_field(classes, n_max),
        )

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        return self.statistics_fields(), 1 if self.closes_after_training() else self.rounds

    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        values = {}
        if self.with_statistics(state):
            model = self.load(state.model)
            with placed(model, self.device):
                z = extract_features(model, torch.from_numpy(data.x))
            if self.dp:
                z = clip_features(z, self.dp.feature_norm)
            bound = self.options.feature_bound
            y = torch.from_numpy(data.y).to(z.device)
            values = {k: v.cpu() for k, v in self.statistics(z.clamp(-bound, bound), y, ctx).items()}
            if self.dp:
                values["count"] = reported_counts(data.class_counts(), ctx)
        if not self.closing(state):
            values.update(self.trained_delta(state, data, ctx))
        return self.schema(state).contribution(**values)

    def statistics(self, z: torch.Tensor, y: torch.Tensor, ctx: SiloContext) -> dict[str, torch.Tensor]:
        """The values of `statistics_fields` for one silo's (clipped) features, on their device."""
        return class_sums(z, y, self.model_spec.num_classes)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        trained = state.extra["trained"]
        if self.closing(state):
            weight, bias = self.fit_head(state.model, sums, ctx)
            extra = {"trained": trained, "head.weight": weight, "head.bias": bias}
            return GlobalState(state.round + 1, state.model, extra)
        model = self.averaged_model(state, sums)
        extra = {"trained": trained + 1}
        if self.with_statistics(state):
            extra["head.weight"], extra["head.bias"] = self.fit_head(model, sums, ctx)
        return GlobalState(state.round + 1, model, extra)

    def pooled(self, sums: Sums, *, unbiased: bool = True) -> ClassGaussians:
        """The class Gaussians of the summed statistics; refuses sums in which no class has any."""
        gaussians = ClassGaussians.from_sums(
            sums["feature_sum"], sums["outer_sum"], sums["count"], unbiased=unbiased
        )
        if not gaussians.present.any():
            raise ContributionError("no class has any feature statistics; no head can be fitted to them")
        return gaussians

    @abstractmethod
    def fit_head(
        self, model: dict[str, torch.Tensor], sums: Sums, ctx: ServerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluated head for `model`'s backbone, from the summed statistics."""

    def eval_model(self, state: GlobalState) -> SplitModel:
        if "head.weight" not in state.extra:
            return self.load(state.model)
        return self.load(with_head(state.model, state.extra["head.weight"], state.extra["head.bias"]))
