"""SFD (KDD 2025): synthetic feature-based decoupled training — ABBL training, then SAFS and fine-tuning.

Training rounds: FedAvg whose local objective is ABBL (Eq. 8) — adaptive cross-entropy with the local prior
(Eq. 5–6, γ = 0.1, β_π = 1) plus β_SCL^(r)·adaptive supervised contrast on a projector head (Eq. 7, τ = 0.07,
Δ = log π of the negative's class), β_SCL cosine-annealed from 0.1 over the rounds (Eq. 28). The projector
(Linear d→256, BatchNorm, ReLU, Linear 256→128, as the official code) is averaged with the model and unused
at inference.

Closing round (see `posthoc`): per class Σz, Σzzᵀ, Σφ(z) and counts on the final encoder, where φ are
random Fourier features (RBF γ = 0.01, orthogonal, D = 3000 as the official code) built from the run seed
the RoundSpec carries. The server pools them (Eq. 10: population covariance), synthesises M_c features per
class with SAFS (`safs`), M_c from 2000 for the rarest class to 600 for the most frequent by rank, and
fine-tunes the global head on them (SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64, 100 epochs,
cosine annealing). The evaluated model is the final backbone with the fine-tuned head.

Ablations (configurable): `local_loss = "ce"` (plain cross-entropy instead of ABBL), `aligner = false`
(features synthesised by the loss alone), `mmd = false` (no MMD term).
Deviations: the model's classifier keeps its bias during training (the official learning classifier has
none, and its fine-tuning starts the bias from a random initialisation); the fine-tuning learning rate is
annealed once over the epochs (the official scheduler is stepped per iteration with T_max = epochs, so its
rate oscillates); the orthogonal random features are the textbook construction (see `rff`). Classes with no
statistics (or held back by the tail guard) get no synthetic features.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.aggregation import Field, Sums
from fedlt.config import setting
from fedlt.device import model_device
from fedlt.errors import ConfigError
from fedlt.methods.abbl import (
    adaptive_contrastive,
    adaptive_cross_entropy,
    contrastive_weight,
    prior_of_counts,
)
from fedlt.methods.base import ServerContext, SiloContext, reported_counts
from fedlt.methods.feature_stats import class_sums
from fedlt.methods.heads import head_of, retrain_head
from fedlt.methods.local import train_local
from fedlt.methods.posthoc import PostHocHead, StatisticsOptions
from fedlt.methods.rff import RandomFourierFeatures
from fedlt.methods.safs import SynthesisSettings, synthesize_class, synthetic_counts
from fedlt.methods.state import GlobalState
from fedlt.models import SplitModel
from fedlt.seeding import derive_seed, torch_generator


@dataclass(frozen=True)
class SFDOptions(StatisticsOptions):
    local_loss: str = setting("abbl", choices=("abbl", "ce"), doc="ABBL, or plain cross-entropy (ablation)")
    gamma: float = setting(0.1, ge=0.0, doc="γ, logit adjustment of A-CE")
    beta_pi: float = setting(1.0, ge=0.0, le=1.0, doc="β_π, prior of missing classes")
    scl_weight: float = setting(0.1, ge=0.0, doc="β_SCL in round 1, cosine-annealed to 0")
    temperature: float = setting(0.07, gt=0.0, doc="τ of A-SCL")
    projector_hidden: int = setting(256, ge=1)
    projector_dim: int = setting(128, ge=1)
    rff_features: int = setting(3000, ge=2, doc="D, random Fourier features (even)")
    rbf_gamma: float = setting(0.01, gt=0.0, doc="γ of the RBF kernel exp(−γ‖x − y‖²)")
    rff_orthogonal: bool = setting(True, doc="orthogonal random features (else Gaussian)")
    synthetic_most: int = setting(2000, ge=1, doc="M_c of the rarest class")
    synthetic_fewest: int = setting(600, ge=1, doc="M_c of the most frequent class")
    synthesis_steps: int = setting(100, ge=0)
    synthesis_lr: float = setting(1.0, gt=0.0)
    aligner: bool = setting(True, doc="MeanCov aligner (ablation: false)")
    mmd: bool = setting(True, doc="random-feature MMD term (ablation: false)")
    target_eps: float = setting(1e-5, ge=0.0, doc="added to the global covariance's diagonal")
    input_eps: float = setting(1e-6, ge=0.0, doc="added to the bank covariance's diagonal")
    finetune_epochs: int = setting(100, ge=1)
    finetune_lr: float = setting(0.01, gt=0.0)
    finetune_momentum: float = setting(0.9, ge=0.0, le=1.0)
    finetune_weight_decay: float = setting(1e-5, ge=0.0)
    finetune_batch: int = setting(64, ge=1)


class SFD(PostHocHead):
    name = "sfd"
    Options = SFDOptions

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        o = self.options
        problems = []
        if o.rff_features % 2:
            problems.append(f"method.rff_features: must be even, got {o.rff_features}")
        if o.synthetic_fewest > o.synthetic_most:
            problems.append("method.synthetic_fewest: must not exceed synthetic_most")
        if o.aligner and o.synthetic_fewest <= self.feature_dim:
            problems.append(
                f"method.synthetic_fewest: the aligner needs more synthetic features per class than the "
                f"{self.feature_dim} feature dimensions (a full-rank covariance), got {o.synthetic_fewest}"
            )
        if self.dp and o.local_loss != "ce" and o.scl_weight > 0:
            problems.append(
                "method.scl_weight: must be 0 under [dp]: the supervised contrastive loss ties each record's "
                "gradient to the other records of its batch, so DP-SGD's clipping cannot bound one record"
            )
        if problems:
            raise ConfigError("method", problems)

    def build_model(self, seed: int) -> SplitModel:
        model = self.model_spec.build(seed)
        o = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "projector"))
            model.projector = nn.Sequential(
                nn.Linear(model.feature_dim, o.projector_hidden),
                nn.BatchNorm1d(o.projector_hidden),
                nn.ReLU(),
                nn.Linear(o.projector_hidden, o.projector_dim),
            )
        return model

    def train_model(
        self, model: SplitModel, x: torch.Tensor, y: torch.Tensor, state: GlobalState, ctx: SiloContext
    ) -> None:
        model.projector.requires_grad_(not self.dp)  # under DP the contrastive term is off: nothing trains it
        if self.options.local_loss == "ce":
            super().train_model(model, x, y, state, ctx)
            return
        o = self.options
        # the prior is a statistic of every record: under DP, of the counts noised once per run
        counts = reported_counts(torch.bincount(y, minlength=model.num_classes).numpy(), ctx)
        prior = prior_of_counts(counts.float(), o.beta_pi).to(model_device(model))
        weight = contrastive_weight(
            o.scl_weight, min(self.trained_rounds(state) + 1, self.rounds), self.rounds
        )

        def abbl(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            h = model.encoder(xb)
            loss = adaptive_cross_entropy(model.classifier(h), yb, prior, o.gamma)
            if weight > 0 and len(yb) > 1:  # BatchNorm in the projector needs two samples
                loss = loss + weight * adaptive_contrastive(model.projector(h), yb, prior, o.temperature)
            return loss

        train_local(model, x, y, self.train, ctx.generator("shuffle"), loss=abbl, private=ctx.private)

    def random_features(self, seed: int) -> RandomFourierFeatures:
        o = self.options
        return RandomFourierFeatures(
            self.feature_dim,
            o.rff_features,
            o.rbf_gamma,
            orthogonal=o.rff_orthogonal,
            seed=derive_seed(seed, "sfd-rff"),
        )

    def statistics_fields(self) -> tuple[Field, ...]:
        classes, n_max, features = (
            self.model_spec.num_classes,
            float(self.options.max_silo_samples),
            self.options.rff_features,
        )
        bound = n_max * (2.0 / features) ** 0.5  # |φ| ≤ √(2/D) per element
        rff = Field(
            "rff_sum",
            (classes, features),
            bound,
            "per class Σφ(z)",
            frac_bits=32,
            per_class=True,
            sensitivity=1.0 if self.dp else 0.0,  # ‖φ(z)‖ = 1: D/2 pairs of √(2/D)·(cos, sin)
            inverts=True,  # one record's φ(z) pins z down (its phases, D/2 of them)
        )
        return (*super().statistics_fields(), rff)

    def statistics(self, z: torch.Tensor, y: torch.Tensor, ctx: SiloContext) -> dict[str, torch.Tensor]:
        phi = self.random_features(ctx.seed)(z.double())
        members = F.one_hot(y, self.model_spec.num_classes).double()
        return {**class_sums(z, y, self.model_spec.num_classes), "rff_sum": members.T @ phi}

    def fit_head(
        self, model: dict[str, torch.Tensor], sums: Sums, ctx: ServerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        features, labels = self.synthetic_features(sums, ctx)
        generator = torch_generator(derive_seed(ctx.seed, "sfd-finetune", ctx.round))
        return self.fine_tuned(model, features, labels, generator)

    def fine_tuned(
        self,
        model: dict[str, torch.Tensor],
        features: torch.Tensor,
        labels: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global head fine-tuned on synthetic features."""
        o = self.options
        return retrain_head(
            features,
            labels,
            *head_of(model),
            epochs=o.finetune_epochs,
            lr=o.finetune_lr,
            batch_size=o.finetune_batch,
            momentum=o.finetune_momentum,
            weight_decay=o.finetune_weight_decay,
            generator=generator,
            cosine=True,
        )

    def synthetic_features(
        self, sums: Sums, ctx: ServerContext, classes: Collection[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SAFS for every class with statistics, or for those among `classes` (what the privacy audit decodes;
        M_c is still ranked among every present class): (features, labels)."""
        o = self.options
        stats = self.pooled(sums, unbiased=False)
        present = torch.nonzero(stats.present).flatten()
        rff_means = sums["rff_sum"] / stats.counts.clamp(min=1)[:, None]
        counts = synthetic_counts(stats.counts[present], o.synthetic_most, o.synthetic_fewest)
        if classes is not None:
            chosen = torch.isin(present, torch.as_tensor(list(classes), dtype=present.dtype))
            present, counts = present[chosen], counts[chosen]
        settings = SynthesisSettings(
            steps=o.synthesis_steps,
            lr=o.synthesis_lr,
            target_eps=o.target_eps,
            input_eps=o.input_eps,
            aligner=o.aligner,
            mmd=o.mmd,
        )
        rff = self.random_features(ctx.seed)
        generator = torch_generator(derive_seed(ctx.seed, "sfd-safs", ctx.round))
        features = [
            synthesize_class(
                int(m), stats.means[c], stats.covariances[c], rff_means[c], rff, settings, generator
            )
            for c, m in zip(present.tolist(), counts.tolist(), strict=True)
        ]
        labels = torch.cat(
            [torch.full((int(m),), c) for c, m in zip(present.tolist(), counts.tolist(), strict=True)]
        )
        return torch.cat(features), labels
