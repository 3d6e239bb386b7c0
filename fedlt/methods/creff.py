"""CReFF (Shang et al., IJCAI 2022): classifier re-training with federated features.

Silo half: FedAvg local training from the global model w^t (Eq. 1), plus, per class the silo holds, the mean
gradient of the re-trained head v̂^t's weight and bias over the silo's real features of that class, computed on
the global backbone u^t before local training (Eq. 3), and a presence flag. The consortium sums both, so the
server forms Eq. 4's mean over the silos holding each class from two sums and never sees a silo's class set.

Server half: FedAvg (Eq. 2); then I steps of SGD on persistent federated features S (m per class, N(0, 1) at
start, never re-initialised) that minimise the per-row cosine distance (Eq. 6) between the features' head
gradient (Eq. 5) and the aggregated real one, summed over the classes present this round; then a fresh head
trained J epochs on S (Eq. 7). The evaluated model is the FedAvg backbone with the re-trained head; local
training always starts from the plain FedAvg model, as in the official code.

Defaults are the paper's and the official code's: m = 100, I = 100 with lr 0.1, J = 300 epochs with lr 0.01
and batch 32, and the official `distance_wb`: 1 − cos per row of ∇W summed over rows, plus 1 − cos of ∇b.
Deviations: Eq. 3 is taken literally — the mean over all of a silo's samples of the class — where the
official code averages 10 draws of at most 32 DSA-augmented images; `row_reduction = "mean"` gives Eq. 6's
1/C instead of the official sum (a rescaling of the feature learning rate). Gradients are clipped to
`grad_bound` per element so the summed field has a known range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.methods.base import ServerContext, SiloContext, reported_counts
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.heads import (
    class_gradient_fields,
    class_gradient_values,
    fresh_head,
    mean_over_holders,
    retrain_head,
    with_head,
)
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel
from fedlt.seeding import derive_seed, torch_generator

COSINE_EPS = 1e-6  # the official match loss's guard against zero norms


@dataclass(frozen=True)
class CReFFOptions(FedAvgOptions):
    features_per_class: int = setting(100, ge=1, doc="m, federated features per class")
    match_steps: int = setting(100, ge=0, doc="I, gradient-matching steps per round")
    feature_lr: float = setting(0.1, gt=0.0, doc="SGD learning rate of the federated features")
    retrain_epochs: int = setting(300, ge=1, doc="J, epochs of head re-training on the features")
    retrain_lr: float = setting(0.01, gt=0.0, doc="SGD learning rate of the re-trained head")
    retrain_batch: int = setting(32, ge=1, doc="mini-batch size of head re-training")
    row_reduction: str = setting(
        "sum", choices=("sum", "mean"), doc="sum over ∇W rows (official code) or mean (Eq. 6)"
    )
    grad_bound: float = setting(100.0, gt=0.0, doc="largest |gradient| element a silo reports")


class CReFF(FedAvg):
    name = "creff"
    Options = CReFFOptions

    def init_state(self, *, seed: int) -> GlobalState:
        state = super().init_state(seed=seed)
        spec, m = self.model_spec, self.options.features_per_class
        dim = self.feature_dim
        generator = torch_generator(seed, "creff-init")
        weight, bias = fresh_head(dim, spec.num_classes, generator)
        features = torch.randn(spec.num_classes * m, dim, generator=generator)
        return GlobalState(0, state.model, {"features": features, "head.weight": weight, "head.bias": bias})

    def _schema(self, state: GlobalState) -> Schema:
        classes, dim = state.extra["head.weight"].shape
        return Schema((*self.model_fields(state), *self.gradient_fields(classes, dim)))

    def gradient_fields(self, classes: int, dim: int) -> tuple[Field, ...]:
        return class_gradient_fields(
            classes,
            dim,
            self.options.grad_bound,
            "the re-trained head (Eq. 3)",
            dp=self.dp,
            n_max=float(self.options.max_silo_samples),
        )

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        return self.gradient_fields(self.model_spec.num_classes, self.feature_dim), self.rounds

    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        # the gradients are taken on the received backbone, before local training moves it
        model = self.load(with_head(state.model, state.extra["head.weight"], state.extra["head.bias"]))
        grads = class_gradient_values(
            model, data, device=self.device, dp=self.dp, counts=reported_counts(data.class_counts(), ctx)
        )
        return self.schema(state).contribution(**self.trained_delta(state, data, ctx), **grads)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        model = self.averaged_model(state, sums)
        classes, dim = state.extra["head.weight"].shape
        held, real = mean_over_holders(sums["grad"].reshape(classes, classes, dim + 1), sums["present"])
        head = state.extra["head.weight"], state.extra["head.bias"]
        features = self.matched_features(state.extra["features"], head, real.float(), held)
        generator = torch_generator(derive_seed(ctx.seed, "creff-retrain", ctx.round))
        weight, bias = retrain_head(
            features,
            self.feature_labels(classes),
            *fresh_head(dim, classes, generator),
            epochs=self.options.retrain_epochs,
            lr=self.options.retrain_lr,
            batch_size=self.options.retrain_batch,
            generator=generator,
        )
        extra = {"features": features, "head.weight": weight, "head.bias": bias}
        return GlobalState(state.round + 1, model, extra)

    def feature_labels(self, classes: int) -> torch.Tensor:
        return torch.arange(classes).repeat_interleave(self.options.features_per_class)

    def matched_features(
        self,
        features: torch.Tensor,
        head: tuple[torch.Tensor, torch.Tensor],
        real: torch.Tensor,
        held: torch.Tensor,
    ) -> torch.Tensor:
        """I SGD steps on the features of the classes held this round; the others stay as they are."""
        classes = len(held)
        synthetic = features.detach().clone().reshape(classes, -1, features.shape[1]).requires_grad_(True)
        optimizer = torch.optim.SGD([synthetic], lr=self.options.feature_lr)
        for _ in range(self.options.match_steps if held.any() else 0):
            loss = self.matching_loss(synthetic[held], head, real[held], torch.nonzero(held).flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return synthetic.detach().reshape(features.shape)

    def matching_loss(
        self,
        synthetic: torch.Tensor,
        head: tuple[torch.Tensor, torch.Tensor],
        real: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """Σ over classes of Eq. 6 between the features' head gradient (Eq. 5) and the real one.

        `synthetic` (K, m, d) are the features of classes `labels` (K,), `real` (K, C, d + 1) their gradients.
        """
        weight, bias = head
        residual = torch.softmax(synthetic @ weight.T + bias, dim=-1)
        residual = residual - F.one_hot(labels, weight.shape[0]).to(residual.dtype)[:, None, :]
        grad_w = residual.transpose(1, 2) @ synthetic / synthetic.shape[1]  # (K, C, d)
        grad_b = residual.mean(1)  # (K, C)
        rows = 1 - cosine(grad_w, real[:, :, :-1])
        rows = rows.sum(1) if self.options.row_reduction == "sum" else rows.mean(1)
        return (rows + 1 - cosine(grad_b, real[:, :, -1])).sum()

    def eval_model(self, state: GlobalState) -> SplitModel:
        return self.load(with_head(state.model, state.extra["head.weight"], state.extra["head.bias"]))


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity along the last axis, as the official `distance_wb` computes it."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + COSINE_EPS)
