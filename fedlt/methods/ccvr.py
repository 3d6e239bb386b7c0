"""CCVR (Luo et al., NeurIPS 2021): classifier calibration with virtual representations.

Silos contribute, per class, Σz, Σzzᵀ (upper triangle) and the count of their features from the frozen global
encoder (eval mode); the server pools them into class means and unbiased covariances (exactly those of the
pooled features, see `feature_stats`), draws `virtual_per_class` Gaussian features per class and re-trains the
global classifier on them with cross-entropy, starting from the global classifier. The evaluated model is the
global backbone with the calibrated head; training itself is plain FedAvg and never sees the calibrated head.

`calibrate = "post-hoc"` (the paper's setting) runs the calibration once, in one closing round after
training, on the final model's encoder (see `posthoc`). `calibrate = "every-round"` adds the statistics to
every training round: they are taken on the backbone the silos received, and the calibrated head is evaluated
with the new FedAvg backbone — one round behind, as CReFF's re-trained head is.

No official code exists. Defaults: 2000 virtual features per class (smduan/Fed-CCVR's `num_vr`; FL-bench uses
200) and 10 epochs of SGD with momentum 0.9 and weight decay 1e-5 as in smduan/Fed-CCVR, with learning rate
0.01. Features are clipped to `feature_bound` per element so the summed fields have a known range; classes
the tail guard held back (count 0) get no virtual features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlt.aggregation import Sums
from fedlt.config import setting
from fedlt.methods.base import ServerContext
from fedlt.methods.heads import head_of, retrain_head
from fedlt.methods.posthoc import PostHocHead, StatisticsOptions
from fedlt.seeding import derive_seed, torch_generator


@dataclass(frozen=True)
class CCVROptions(StatisticsOptions):
    calibrate: str = setting(
        "post-hoc", choices=("post-hoc", "every-round"), doc="once after training, or in every round"
    )
    virtual_per_class: int = setting(2000, ge=1, doc="Gaussian virtual features drawn per class")
    calibrate_epochs: int = setting(10, ge=1)
    calibrate_lr: float = setting(0.01, gt=0.0)
    calibrate_momentum: float = setting(0.9, ge=0.0, le=1.0)
    calibrate_weight_decay: float = setting(1e-5, ge=0.0)
    calibrate_batch: int = setting(32, ge=1)


class CCVR(PostHocHead):
    name = "ccvr"
    Options = CCVROptions

    def closes_after_training(self) -> bool:
        return self.options.calibrate == "post-hoc"

    def fit_head(
        self, model: dict[str, torch.Tensor], sums: Sums, ctx: ServerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global head re-trained on virtual features drawn from the pooled class Gaussians."""
        gaussians = self.pooled(sums)
        generator = torch_generator(derive_seed(ctx.seed, "ccvr", ctx.round))
        z, y = gaussians.sample(self.options.virtual_per_class, generator)
        return retrain_head(
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
