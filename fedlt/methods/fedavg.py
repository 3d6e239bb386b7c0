"""FedAvg (McMahan et al., AISTATS 2017), sample-weighted: silos contribute (n_k / N_r)·Δw_k and n_k.

w ← w + η_s · N_r · Σ_k (n_k / N_r) Δw_k / Σ_k n_k = w + η_s · Σ_k n_k Δw_k / Σ_k n_k, with η_s = 1 the
paper's rule. Averaged are all floating-point entries of the model's state (parameters and BatchNorm
statistics, as CReFF's official code does). Each element of Δw_k is clipped to `delta_bound` before weighting.

Weighting by n_k / N_r ≤ 1 rather than by n_k keeps the summed field's range at `delta_bound`, not N times
it, so secure aggregation carries it in 32-bit words (`privacy.ring`). The price is absolute
precision: a silo's Δw_k is resolved to about 2^−f · N_r / n_k, so N_r should be near the silos' sizes. It is
`max_silo_samples` in the first round, then twice the samples the previous round summed (kept in the state,
`WEIGHT_SCALE`, which every silo verifies): about 2K · 2^−f for K silos of any size. Where a silo holds more
than N_r samples (possible when rounds train different silos), its weight is capped at N_r, and it reports
n_k = N_r, so the average stays a weighted average; the paper has no such cap. A wrong N_r from a lying
aggregator costs precision or weighting, never privacy: the weight travels inside the secure sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import placed
from fedlt.errors import ContributionError
from fedlt.methods.base import Method, ServerContext, SiloContext
from fedlt.methods.local import train_local
from fedlt.methods.state import GlobalState, flatten, float_keys, unflatten
from fedlt.models import SplitModel

WEIGHT_SCALE = "fedavg.weight_scale"


@dataclass(frozen=True)
class FedAvgOptions:
    server_lr: float = setting(1.0, gt=0.0, doc="η_s; 1 is plain FedAvg")
    delta_bound: float = setting(10.0, gt=0.0, doc="largest |Δw| per element a silo reports")
    max_silo_samples: int = setting(10_000, ge=1, doc="the largest n_k; N_r of the first round")


class FedAvg(Method):
    """Also the training half of the methods built on it, which add fields and server steps of their own."""

    name = "fedavg"
    Options = FedAvgOptions

    def _schema(self, state: GlobalState) -> Schema:
        return Schema(self.model_fields(state))

    def model_fields(self, state: GlobalState) -> tuple[Field, ...]:
        size = sum(state.model[k].numel() for k in float_keys(state.model))
        return (
            Field("delta", (size,), self.options.delta_bound, "(n_k / N_r) · Δw_k"),
            Field(
                "n", (), float(self.options.max_silo_samples), "n_k, the silo's training samples", frac_bits=0
            ),
        )

    def _local_round(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> Contribution:
        return self.schema(state).contribution(**self.trained_delta(state, data, ctx))

    def trained_delta(self, state: GlobalState, data: LabeledData, ctx: SiloContext) -> dict:
        """Local training from the global model: the fields `delta` = (n_k / N_r)·Δw_k and `n` = n_k."""
        n = len(data)
        if not 0 < n <= self.options.max_silo_samples:
            raise ContributionError(
                f"silo {ctx.silo_id} has {n} samples; must be in 1..{self.options.max_silo_samples} "
                "([method] max_silo_samples)"
            )
        model = self.load(state.model)
        keys = float_keys(state.model)
        with placed(model, self.device):
            self.train_model(model, torch.from_numpy(data.x), torch.from_numpy(data.y), state, ctx)
        delta = flatten(model.state_dict(), keys) - flatten(state.model, keys)
        delta = delta.double().clamp(-self.options.delta_bound, self.options.delta_bound)
        if ctx.private is not None:  # the weight is released too: counts noised once per run (DP)
            noisy = float(ctx.private.reported_counts(data.class_counts()).sum())  # unclamped: unbiased
            n = min(max(1, round(noisy)), self.options.max_silo_samples)
        scale = self.weight_scale(state)
        n = min(n, scale)
        return {"delta": (n / scale) * delta, "n": float(n)}

    def weight_scale(self, state: GlobalState) -> int:
        """N_r, the round's weight scale: from the state, or `max_silo_samples` before any round."""
        scale = state.extra.get(WEIGHT_SCALE)
        return self.options.max_silo_samples if scale is None else int(scale)

    def server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        """Every method built on FedAvg carries N_{r+1} = 2 Σ n_k (at most `max_silo_samples`) on."""
        following = super().server_step(state, sums, ctx)
        if "n" not in sums:  # a round that trains no model (a closing statistics round)
            return following
        extra = {**following.extra, **self.weight_scale_entry(float(sums["n"]))}
        return GlobalState(following.round, following.model, extra)

    def weight_scale_entry(self, samples: float) -> dict[str, torch.Tensor]:
        """The state entry N_{r+1} = 2·`samples` (what a round summed), at most `max_silo_samples`."""
        scale = min(2 * max(1, round(samples)), self.options.max_silo_samples)
        return {WEIGHT_SCALE: torch.tensor(scale, dtype=torch.int64)}

    def train_model(
        self, model: SplitModel, x: torch.Tensor, y: torch.Tensor, state: GlobalState, ctx: SiloContext
    ) -> None:
        """Local training of `model`, already on `self.device`, from (x, y) on the CPU."""
        hook = self.before_step(model)
        train_local(model, x, y, self.train, ctx.generator("shuffle"), before_step=hook, private=ctx.private)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        return GlobalState(state.round + 1, self.averaged_model(state, sums), state.extra)

    def averaged_model(self, state: GlobalState, sums: Sums) -> dict[str, torch.Tensor]:
        """w + η_s · N_r · Σ (n_k / N_r) Δw_k / Σ n_k."""
        total = float(sums["n"])
        if total <= 0:
            raise ContributionError("the summed sample count is zero; nothing to average")
        keys = float_keys(state.model)
        scale = self.options.server_lr * self.weight_scale(state) / total
        new = flatten(state.model, keys).double() + scale * sums["delta"]
        return unflatten(new, state.model, keys)
