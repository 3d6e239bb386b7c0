"""DFL-FS: stage 2, classifier re-training on Gaussian features regenerated from global feature statistics.

After the training rounds, silos contribute per class Σz, Σzzᵀ and counts on the final encoder (a closing
round, see `posthoc`); the server pools them into class means and covariances — Eq. 1–2 in outer-product
form, i.e. the unbiased covariance of the pooled features — and re-trains a fresh linear head (SGD lr 0.01,
batch 32, 100 epochs, as the paper) on Gaussian features drawn per class with one of the paper's two
tail-favouring strategies, where a class's rank r runs from 0 for the largest class to C − 1 for the smallest:
- `rs` (re-sampling, Eq. 3): n_c = n_b + n_k·r features of class c (n_b = 500, n_k = 150, the paper's);
- `wc` (weighted covariance, Eq. 4): `per_class` features from N(μ_c, w_c·Σ_c), w_c = w_b + w_k·r
  (w_b = 0.5, w_k = 0.1, the paper's; 1000 per class, the official stage-2 script's count).

Stage 1's training rounds are FedAvg. Its masked feature-statistics clustering (MFSC) and the client
selection it drives are not part of the method but of the round's participant selection, which any method
can use: `[selection] per_round = k, strategy = "mfsc"` (`fedlt.selection`), because MFSC is a per-silo
disclosure rather than a sum and the consortium must agree to it (the paper's setting: 20 of 100 clients per
round). The official repository's stage 1 is plain FedAvg over all clients. Classes with no statistics (or
held back by the tail guard) get no features.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedlt.aggregation import Sums
from fedlt.config import setting
from fedlt.methods.base import ServerContext
from fedlt.methods.feature_stats import ClassGaussians
from fedlt.methods.heads import fresh_head, retrain_head
from fedlt.methods.posthoc import PostHocHead, StatisticsOptions
from fedlt.seeding import derive_seed, torch_generator


@dataclass(frozen=True)
class DFLFSOptions(StatisticsOptions):
    strategy: str = setting("rs", choices=("rs", "wc"), doc="re-sampling or weighted covariance")
    rs_base: int = setting(500, ge=1, doc="n_b of re-sampling")
    rs_growth: int = setting(150, ge=0, doc="n_k of re-sampling, per rank")
    wc_base: float = setting(0.5, gt=0.0, doc="w_b of weighted covariance")
    wc_growth: float = setting(0.1, ge=0.0, doc="w_k of weighted covariance, per rank")
    per_class: int = setting(1000, ge=1, doc="features per class with weighted covariance")
    retrain_epochs: int = setting(100, ge=1)
    retrain_lr: float = setting(0.01, gt=0.0)
    retrain_batch: int = setting(32, ge=1)


class DFLFS(PostHocHead):
    name = "dflfs"
    Options = DFLFSOptions

    def fit_head(
        self, model: dict[str, torch.Tensor], sums: Sums, ctx: ServerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gaussians = self.pooled(sums)
        generator = torch_generator(derive_seed(ctx.seed, "dflfs", ctx.round))
        z, y = self.regenerated(gaussians, generator)
        classes, dim = gaussians.means.shape
        return retrain_head(
            z,
            y,
            *fresh_head(dim, classes, generator),
            epochs=self.options.retrain_epochs,
            lr=self.options.retrain_lr,
            batch_size=self.options.retrain_batch,
            generator=generator,
        )

    def regenerated(
        self, gaussians: ClassGaussians, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussian features per present class, tail classes favoured by the configured strategy."""
        o = self.options
        rank = tail_rank(gaussians.counts).double()
        if o.strategy == "rs":
            counts = (o.rs_base + o.rs_growth * rank).long()
            return gaussians.sample_counts(counts, generator)
        weights = o.wc_base + o.wc_growth * rank
        widened = replace(gaussians, covariances=gaussians.covariances * weights[:, None, None])
        return widened.sample(o.per_class, generator)


def tail_rank(counts: torch.Tensor) -> torch.Tensor:
    """0 for the largest class up to C − 1 for the smallest (ties by class index), over all classes."""
    order = torch.sort(-counts, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(counts))
    return rank
