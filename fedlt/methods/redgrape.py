"""RedGrape (TMLR): decentralised decoupled training with a supplementary classifier and gradient prototypes.

The network gains a supplementary head Ŵ next to the main head W. Local training is instance-balanced on
the logits Wh + Ŵh (Eq. 7–8), so the encoder and Ŵ fit the long-tailed data; W is additionally re-balanced
at every step by g_bal (Eq. 12): the gradient of W on the local balanced set — T samples of every class the
silo holds at least T of — mixed with the global gradient prototypes of the other classes, and scaled to the
norm of W's local gradient (Eq. 13). Inference uses W only (Eq. 16).

Prototypes are sums: each silo contributes, per class it holds, the mean head gradient of W over all its
samples of the class on the received global model (Eq. 11), plus a presence flag; the server divides the two
sums (Eq. 10) and keeps a class's previous prototype when no silo held it this round (Eq. 15). All of W, Ŵ
and the encoder are averaged by FedAvg (Eq. 14).

As in the official code: λ = 0.1 and T = 8 (its run script), the re-balancing enters as an extra plain step
W ← W − lr·λ·g_bal after the optimizer's step (identical to Eq. 13 for plain SGD; with momentum only the
instance-balanced gradient carries momentum), scaled per tensor (weight and bias), the balanced batch passes
the encoder in training mode (BatchNorm statistics included) without gradients, prototypes are computed in
eval mode, and no re-balancing happens until some prototype exists. Deviations: the official runs also add a
FedProx term (μ = 0.1) and clip gradients to norm 1 in every method, baselines included; here all methods
train without them. Classes with no prototype yet are left out of Eq. 12 (the official code substitutes the
mean of the others) — the scaling makes the mix's overall factor irrelevant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import model_device
from fedlt.methods.base import ServerContext, SiloContext, reported_counts
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.heads import class_gradient_fields, class_gradient_values, head_gradient, mean_over_holders
from fedlt.methods.local import train_local
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel
from fedlt.seeding import derive_seed


@dataclass(frozen=True)
class RedGrapeOptions(FedAvgOptions):
    lam: float = setting(0.1, ge=0.0, doc="λ, strength of the re-balancing step; 0 is FedAvg with two heads")
    threshold: int = setting(8, ge=1, doc="T: classes with at least T local samples join the balanced set")
    grad_bound: float = setting(100.0, gt=0.0, doc="largest |gradient| element a silo reports")


class RedGrape(FedAvg):
    name = "redgrape"
    Options = RedGrapeOptions

    def build_model(self, seed: int) -> SplitModel:
        model = self.model_spec.build(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "supplementary-head"))
            model.supplementary = nn.Linear(model.feature_dim, model.num_classes)
        return model

    def init_state(self, *, seed: int) -> GlobalState:
        state = super().init_state(seed=seed)
        classes, dim = self.model_spec.num_classes, self.feature_dim
        extra = {"prototypes": torch.zeros(classes, classes, dim + 1), "known": torch.zeros(classes)}
        return GlobalState(0, state.model, extra)

    def _schema(self, state: GlobalState) -> Schema:
        return Schema((*self.model_fields(state), *self.statistics_plan()[0]))

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        grads = class_gradient_fields(
            self.model_spec.num_classes,
            self.feature_dim,
            self.options.grad_bound,
            "the main head W (Eq. 11)",
            dp=self.dp,
            n_max=float(self.options.max_silo_samples),
        )
        return grads, self.rounds

    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        counts = reported_counts(data.class_counts(), ctx)  # the gradients are taken on the received model
        model = self.load(state.model)
        grads = class_gradient_values(model, data, device=self.device, dp=self.dp, counts=counts)
        return self.schema(state).contribution(**self.trained_delta(state, data, ctx), **grads)

    def train_model(
        self, model: SplitModel, x: torch.Tensor, y: torch.Tensor, state: GlobalState, ctx: SiloContext
    ) -> None:
        balanced = balanced_indices(y, self.options.threshold, ctx.generator("balanced-set"))
        if ctx.private is not None:  # under DP the step may use released prototypes only, no local records
            balanced = balanced[:0]
        step = Rebalancing(model, x[balanced], y[balanced], state.extra, self.options.lam, self.train.lr)
        hooks = {"before_step": step.capture, "after_step": step.apply} if step.active else {}
        train_local(
            model,
            x,
            y,
            self.train,
            ctx.generator("shuffle"),
            loss=two_stream_loss,
            private=ctx.private,
            **hooks,
        )

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        prototypes = state.extra["prototypes"]
        held, means = mean_over_holders(sums["grad"].reshape(prototypes.shape), sums["present"])
        extra = {
            "prototypes": torch.where(held[:, None, None], means.float(), prototypes),
            "known": torch.maximum(state.extra["known"], held.float()),
        }
        return GlobalState(state.round + 1, self.averaged_model(state, sums), extra)


def two_stream(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Wh + Ŵh: the instance-balanced logits of local training."""
    h = model.encoder(x)
    return model.classifier(h) + model.supplementary(h)


def two_stream_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(two_stream(model, x), y, reduction="none")


def balanced_indices(y: torch.Tensor, threshold: int, generator: torch.Generator) -> torch.Tensor:
    """T random samples of every class with at least T: the local balanced set D_k^bal, drawn once a round."""
    chosen = []
    for c in torch.unique(y).tolist():
        members = torch.nonzero(y == c).flatten()
        if len(members) >= threshold:
            chosen.append(members[torch.randperm(len(members), generator=generator)[:threshold]])
    return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64)


class Rebalancing:
    """Eq. 12–13 as two hooks: `capture` forms g_bal after the backward pass, `apply` steps W along it."""

    def __init__(
        self,
        model: SplitModel,
        x_bal: torch.Tensor,
        y_bal: torch.Tensor,
        extra: dict[str, torch.Tensor],
        lam: float,
        lr: float,
    ) -> None:
        device = model_device(model)
        self.model, self.x_bal, self.y_bal = model, x_bal.to(device), y_bal.to(device)
        self.step_size = lam * lr
        local_classes = torch.zeros(model.num_classes, dtype=torch.bool)
        local_classes[torch.unique(y_bal)] = True
        self.local_count = int(local_classes.sum())
        borrowed = (extra["known"] > 0) & ~local_classes
        # Σ of prototypes for classes not held locally
        self.borrowed = extra["prototypes"][borrowed].sum(0).to(device)
        self.active = lam > 0 and bool((extra["known"] > 0).any())
        self.update: tuple[torch.Tensor, torch.Tensor] | None = None

    def capture(self) -> None:
        head = self.model.classifier
        with torch.no_grad():
            mixed = self.borrowed.clone()
            if self.local_count:
                h = self.model.encoder(self.x_bal)
                mixed += self.local_count * head_gradient(head.weight, head.bias, h, self.y_bal)
            mixed /= self.model.num_classes
            self.update = (
                scaled_like(mixed[:, :-1], head.weight.grad),
                scaled_like(mixed[:, -1], head.bias.grad),
            )

    def apply(self) -> None:
        head = self.model.classifier
        with torch.no_grad():
            head.weight -= self.step_size * self.update[0]
            head.bias -= self.step_size * self.update[1]


def scaled_like(direction: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """`direction` at the norm of `reference`: Eq. 13's g_bal·‖g_local‖/‖g_bal‖ (zero if either is zero)."""
    norm = direction.norm()
    if reference is None or norm == 0:
        return torch.zeros_like(direction)
    return direction * (reference.norm() / norm)
