"""FedAvg (McMahan et al., AISTATS 2017), sample-weighted: silos contribute n_k·Δw_k and n_k.

w ← w + η_s · Σ_k n_k Δw_k / Σ_k n_k, with η_s = 1 the paper's rule. Averaged are all floating-point entries
of the model's state (parameters and BatchNorm statistics, as CReFF's official code does).
Each element of Δw_k is clipped to `delta_bound` before weighting so the summed field has a known range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlt.aggregation import Contribution, Field, Schema, Sums
from fedlt.config import setting
from fedlt.data.arrays import LabeledImages
from fedlt.errors import ContributionError
from fedlt.methods.base import Method, ServerContext, SiloContext
from fedlt.methods.local import train_local
from fedlt.methods.state import GlobalState, flatten, float_keys, unflatten
from fedlt.models import SplitModel


@dataclass(frozen=True)
class FedAvgOptions:
    server_lr: float = setting(1.0, gt=0.0, doc="η_s; 1 is plain FedAvg")
    delta_bound: float = setting(10.0, gt=0.0, doc="largest |Δw| per element a silo reports")
    max_silo_samples: int = setting(1_000_000, ge=1, doc="largest n_k; sizes the summed ranges")


class FedAvg(Method):
    """Also the training half of the methods built on it, which add fields and server steps of their own."""

    name = "fedavg"
    Options = FedAvgOptions

    def schema(self, state: GlobalState) -> Schema:
        return Schema(self.model_fields(state))

    def model_fields(self, state: GlobalState) -> tuple[Field, ...]:
        size = sum(state.model[k].numel() for k in float_keys(state.model))
        n_max = self.options.max_silo_samples
        return (
            Field("delta", (size,), n_max * self.options.delta_bound, "n_k · Δw_k"),
            Field("n", (), float(n_max), "n_k, the silo's training samples", frac_bits=0),
        )

    def local_round(self, state: GlobalState, data: LabeledImages, ctx: SiloContext) -> Contribution:
        return self.schema(state).contribution(**self.trained_delta(state, data, ctx))

    def trained_delta(self, state: GlobalState, data: LabeledImages, ctx: SiloContext) -> dict:
        """Local training from the global model: the fields `delta` = n_k·Δw_k and `n` = n_k."""
        n = len(data)
        if not 0 < n <= self.options.max_silo_samples:
            raise ContributionError(
                f"silo {ctx.silo_id} has {n} samples; must be in 1..{self.options.max_silo_samples}"
            )
        model = self.load(state.model)
        keys = float_keys(state.model)
        self.train_model(model, torch.from_numpy(data.x), torch.from_numpy(data.y), state, ctx)
        delta = flatten(model.state_dict(), keys) - flatten(state.model, keys)
        delta = delta.double().clamp(-self.options.delta_bound, self.options.delta_bound)
        if ctx.private is not None:  # the weight is released too: counts noised once per run (DP)
            noisy = float(ctx.private.reported_counts(data.class_counts()).sum())  # unclamped: unbiased
            n = min(max(1, round(noisy)), self.options.max_silo_samples)
        return {"delta": n * delta, "n": float(n)}

    def train_model(
        self, model: SplitModel, x: torch.Tensor, y: torch.Tensor, state: GlobalState, ctx: SiloContext
    ) -> None:
        hook = self.before_step(model)
        train_local(model, x, y, self.train, ctx.generator("shuffle"), before_step=hook, private=ctx.private)

    def _server_step(self, state: GlobalState, sums: Sums, ctx: ServerContext) -> GlobalState:
        return GlobalState(state.round + 1, self.averaged_model(state, sums), state.extra)

    def averaged_model(self, state: GlobalState, sums: Sums) -> dict[str, torch.Tensor]:
        """w + η_s · Σ n_k Δw_k / Σ n_k."""
        total = float(sums["n"])
        if total <= 0:
            raise ContributionError("the summed sample count is zero; nothing to average")
        keys = float_keys(state.model)
        new = flatten(state.model, keys).double() + self.options.server_lr * sums["delta"] / total
        return unflatten(new, state.model, keys)
