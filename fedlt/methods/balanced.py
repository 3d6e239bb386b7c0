"""fedlt's own long-tail recipe: global class priors by a secure sum, then FedAvg with prior-adjusted local
training. Not a paper's method.

Two phases, each a sum, and an optional third:
1. **Priors** (one opening round, every silo): per class record counts n_k,c; the server keeps N_c = Σ_k n_k,c
   and the prior π_c = N_c / Σ N. Under DP the counts are those noised once per run that every method reports.
2. **Training** (R rounds): FedAvg whose local loss is the logit-adjusted cross-entropy of Menon et al. (ICLR
   2021, Eq. 10) with the global prior, ℓ(x, y) = −log softmax(f(x) + τ·log π)_y; τ = 1 is Balanced Softmax
   (Ren et al., NeurIPS 2020). Fitting f(x) + τ·log π to the long-tailed data leaves f(x) estimating a
   posterior tilted towards the tail, so tail classes are not pushed down at every step and the backbone keeps
   features for them. Every silo adjusts by the same global prior, so the sum of the local objectives is the
   centralised logit-adjusted objective; `prior = "local"` adjusts by the silo's own counts instead
   (FedLC-like, for comparison). The evaluated model is f(x) alone. τ = 1.5 by default: on the accuracy
   table's protocol (3 seeds) it kept τ = 1's overall accuracy and raised the few-shot classes' by 4 points
   (docs/BENCHMARKS.md). Each local batch is moved by a random whole-pixel offset of up to `shift` of the
   image's side on each axis (2 pixels of MNIST's 28): a class of 4 records is 4 points to the backbone
   otherwise, and a moved digit is still the digit. It changes nothing that leaves the silo.
3. **Calibration** (`calibrate = "post-hoc"` or `"every-round"`, off by default): CCVR's head re-training on
   Gaussian virtual features from per-class Σz, Σzzᵀ and counts (`ccvr`, `posthoc`), `virtual_per_class` per
   class. Off because on this recipe's backbone it cost the few-shot classes 0-9 points on every run measured
   (a class of 4-18 records gives a covariance of rank 3-17 in 512 dimensions, so its virtual features are too
   narrow), and it releases second moments of every silo's features that the default does not.

A class the tail guard held back in the priors round (fewer than k_min silos hold it) has N_c = 0: its prior
is `beta_pi` times the smallest prior of a revealed class (such a class is held by one silo or so, and so is
likely among the rarest), never 0, whose logarithm would drop it from the softmax. The priors round also sets
the first training round's weight scale N_1 = 2·Σ N_c (`fedavg`), so round 1 carries the model change at the
later rounds' precision. Rounds that train a subset of silos can pick them with MFSC (`[selection] strategy =
"mfsc"`); the priors round takes every silo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import model_device
from fedlt.errors import ContributionError
from fedlt.methods.abbl import adaptive_cross_entropy, prior_of_counts
from fedlt.methods.augment import random_shift, shift_pixels
from fedlt.methods.base import ServerContext, SiloContext, reported_counts
from fedlt.methods.ccvr import CCVR, CCVROptions
from fedlt.methods.local import train_local
from fedlt.methods.posthoc import count_field
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel

PRIORS = "priors"
CLASS_COUNTS = "balanced.class_counts"


@dataclass(frozen=True)
class BalancedOptions(CCVROptions):
    tau: float = setting(1.5, ge=0.0, doc="τ of the logit adjustment; 1 is Balanced Softmax, 0 plain CE")
    prior: str = setting("global", choices=("global", "local"), doc="whose class counts adjust the logits")
    beta_pi: float = setting(1.0, gt=0.0, doc="a held-back class's prior, times the smallest revealed one")
    calibrate: str = setting(
        "none",
        choices=("none", "post-hoc", "every-round"),
        doc="re-train the head on virtual features once after training, in every round, or never",
    )
    virtual_per_class: int = setting(1000, ge=1, doc="Gaussian virtual features drawn per class")
    shift: float = setting(
        0.07, ge=0.0, le=0.25, doc="largest move of an image in local training as a fraction of its side"
    )


class Balanced(CCVR):
    name = "balanced"
    Options = BalancedOptions

    def closes_after_training(self) -> bool:
        return self.options.calibrate == "post-hoc"

    def with_statistics(self, state: GlobalState) -> bool:
        return self.options.calibrate != "none" and super().with_statistics(state)

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        return super().statistics_plan() if self.options.calibrate != "none" else ((), 0)

    def priors_known(self, state: GlobalState) -> bool:
        return CLASS_COUNTS in state.extra

    def remaining_rounds(self, state: GlobalState) -> int:
        return super().remaining_rounds(state) + int(not self.priors_known(state))

    def _trains(self, state: GlobalState) -> bool:
        return self.priors_known(state) and super()._trains(state)

    def _schema(self, state: GlobalState) -> Schema:
        if not self.priors_known(state):
            return Schema(
                (count_field(self.model_spec.num_classes, float(self.options.max_silo_samples)),),
                phase=PRIORS,
            )
        return super()._schema(state)

    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        if not self.priors_known(state):
            return self.schema(state).contribution(count=reported_counts(data.class_counts(), ctx))
        return super()._local_round(state, data, ctx)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        if self.priors_known(state):  # the post-hoc steps keep only their own entries: carry N_c on
            following = super()._server_step(state, sums, ctx)
            extra = {**following.extra, CLASS_COUNTS: state.extra[CLASS_COUNTS]}
            return GlobalState(following.round, following.model, extra)
        counts = sums["count"].round().clamp(min=0)
        if not (counts > 0).any():
            raise ContributionError("no class has a count; the priors round summed nothing")
        extra = {**state.extra, CLASS_COUNTS: counts, **self.weight_scale_entry(float(counts.sum()))}
        return GlobalState(state.round + 1, state.model, extra)

    def train_model(
        self, model: SplitModel, x: torch.Tensor, y: torch.Tensor, state: GlobalState, ctx: SiloContext
    ) -> None:
        if self.options.tau == 0 and self.options.shift == 0:
            super().train_model(model, x, y, state, ctx)
            return
        prior = self.adjusting_prior(state, y, ctx).to(model_device(model))
        tau, shift, moves = self.options.tau, shift_pixels(x, self.options.shift), ctx.generator("shift")

        def adjusted(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return adaptive_cross_entropy(model(random_shift(xb, shift, moves)), yb, prior, tau)

        train_local(model, x, y, self.train, ctx.generator("shuffle"), loss=adjusted, private=ctx.private)

    def adjusting_prior(self, state: GlobalState, y: torch.Tensor, ctx: SiloContext) -> torch.Tensor:
        """π of the logit adjustment, unnormalised (a constant shift of log π changes no softmax)."""
        if self.options.prior == "local":  # a statistic of every record: under DP, the once-noised counts
            counts = reported_counts(torch.bincount(y, minlength=self.model_spec.num_classes).numpy(), ctx)
        else:
            counts = self.global_counts(state)
        return prior_of_counts(counts.float(), self.options.beta_pi)

    def global_counts(self, state: GlobalState) -> torch.Tensor:
        """N_c from the state the aggregator sent, checked: it only steers this silo's loss (its release is
        still a clipped, summed model change), but a malformed one must not reach the training loop."""
        counts = state.extra[CLASS_COUNTS]
        classes = self.model_spec.num_classes
        if (
            counts.shape != (classes,)
            or not counts.dtype.is_floating_point
            or not torch.isfinite(counts).all()
            or (counts < 0).any()
            or not (counts > 0).any()
        ):
            raise ContributionError(
                f"the state's class counts must be {classes} finite, non-negative numbers, not all zero"
            )
        return counts
