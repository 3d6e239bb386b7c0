"""CCVR (Luo et al., NeurIPS 2021): classifier calibration with virtual representations.

Silos contribute, per class, Σz, Σzzᵀ (upper triangle) and the count of their features from the frozen global
encoder (eval mode); the server pools them into class means and unbiased covariances (exactly those of the
pooled features, see `feature_stats`), draws `virtual_per_class` Gaussian features per class and re-trains the
global classifier on them with cross-entropy, starting from the global classifier. The evaluated model is the
global backbone with the calibrated head; training itself is plain FedAvg and never sees the calibrated head.

`calibrate = "post-hoc"` (the paper's setting) runs the calibration once, in one closing round after
training, on the final model's encoder. `calibrate = "every-round"` adds the statistics to every training
round: they are taken on the backbone the silos received, and the calibrated head is evaluated with the new
FedAvg backbone — one round behind, as CReFF's re-trained head is.

No official code exists. Defaults: 2000 virtual features per class (smduan/Fed-CCVR's `num_vr`; FL-bench uses
200) and 10 epochs of SGD with momentum 0.9 and weight decay 1e-5 as in smduan/Fed-CCVR, with learning rate
0.01. Features are clipped to `feature_bound` per element so the summed fields have a known range; classes
the tail guard held back (count 0) get no virtual features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledImages
from fedlt.errors import ContributionError
from fedlt.methods.base import ServerContext, SiloContext
from fedlt.methods.feature_stats import ClassGaussians, class_sums, upper_size
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.heads import extract_features, head_of, retrain_head, with_head
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel
from fedlt.seeding import derive_seed, torch_generator

CALIBRATE = "calibrate"


@dataclass(frozen=True)
class CCVROptions(FedAvgOptions):
    calibrate: str = setting(
        "post-hoc", choices=("post-hoc", "every-round"), doc="once after training, or in every round"
    )
    virtual_per_class: int = setting(2000, ge=1, doc="Gaussian virtual features drawn per class")
    calibrate_epochs: int = setting(10, ge=1)
    calibrate_lr: float = setting(0.01, gt=0.0)
    calibrate_momentum: float = setting(0.9, ge=0.0, le=1.0)
    calibrate_weight_decay: float = setting(1e-5, ge=0.0)
    calibrate_batch: int = setting(32, ge=1)
    feature_bound: float = setting(100.0, gt=0.0, doc="largest |feature| element a silo reports")


class CCVR(FedAvg):
    name = "ccvr"
    Options = CCVROptions

    def init_state(self, *, seed: int) -> GlobalState:
        state = super().init_state(seed=seed)
        return GlobalState(0, state.model, {"trained": torch.tensor(0)})

    def trained_rounds(self, state: GlobalState) -> int:
        return int(state.extra["trained"])

    def remaining_rounds(self, state: GlobalState) -> int:
        closing = self.options.calibrate == "post-hoc" and "head.weight" not in state.extra
        return super().remaining_rounds(state) + int(closing)

    def calibrating(self, state: GlobalState) -> bool:
        return self.options.calibrate == "post-hoc" and self.trained_rounds(state) >= self.rounds

    def with_statistics(self, state: GlobalState) -> bool:
        return self.calibrating(state) or self.options.calibrate == "every-round"

    def schema(self, state: GlobalState) -> Schema:
        if self.calibrating(state):
            return Schema(self.statistics_fields(), phase=CALIBRATE)
        statistics = self.statistics_fields() if self.with_statistics(state) else ()
        return Schema(self.model_fields(state) + statistics)

    def statistics_fields(self) -> tuple[Field, ...]:
        classes, dim = self.model_spec.num_classes, self.feature_dim
        n_max, bound = float(self.options.max_silo_samples), self.options.feature_bound
        return (
            Field("feature_sum", (classes, dim), n_max * bound, "per class Σz", per_class=True),
            Field(
                "outer_sum",
                (classes, upper_size(dim)),
                n_max * bound * bound,
                "per class Σzzᵀ, upper triangle",
                frac_bits=16,
                per_class=True,
            ),
            Field("count", (classes,), n_max, "per class sample count", frac_bits=0, per_class=True),
        )

    def local_round(self, state: GlobalState, data: LabeledImages, ctx: SiloContext) -> Contribution:
        values = self.statistics(state, data) if self.with_statistics(state) else {}
        if not self.calibrating(state):
            values.update(self.trained_delta(state, data, ctx))
        return self.schema(state).contribution(**values)

    def statistics(self, state: GlobalState, data: LabeledImages) -> dict[str, torch.Tensor]:
        z = extract_features(self.load(state.model), torch.from_numpy(data.x))
        bound = self.options.feature_bound
        return class_sums(z.clamp(-bound, bound), torch.from_numpy(data.y), self.model_spec.num_classes)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        trained = state.extra["trained"]
        if self.calibrating(state):
            calibrated = self.calibrated(state.model, sums, ctx)
            return GlobalState(state.round + 1, state.model, {"trained": trained, **calibrated})
        model = self.averaged_model(state, sums)
        calibrated = self.calibrated(model, sums, ctx) if self.options.calibrate == "every-round" else {}
        return GlobalState(state.round + 1, model, {"trained": trained + 1, **calibrated})

    def calibrated(self, model: dict[str, torch.Tensor], sums: Sums, ctx: ServerContext) -> dict:
        """The global head re-trained on virtual features drawn from the pooled class Gaussians."""
        gaussians = ClassGaussians.from_sums(sums["feature_sum"], sums["outer_sum"], sums["count"])
        if not gaussians.present.any():
            raise ContributionError("no class has any feature statistics; nothing to calibrate on")
        generator = torch_generator(derive_seed(ctx.seed, "ccvr", ctx.round))
        z, y = gaussians.sample(self.options.virtual_per_class, generator)
        weight, bias = retrain_head(
            z,
            y,
            *head_of(model),
            epochs=self.options.calibrate_epochs,
            lr=self.options.calibrate_lr,
            batch_size=self.options.calibrate_batch,
            momentum=self.options.calibrate_momentum,
            weight_decay=self.options.calibrate_weight_decay,
            generator=generator,
        )
        return {"head.weight": weight, "head.bias": bias}

    def eval_model(self, state: GlobalState) -> SplitModel:
        if "head.weight" not in state.extra:
            return self.load(state.model)
        return self.load(with_head(state.model, state.extra["head.weight"], state.extra["head.bias"]))
