"""The first layer of every table model: each numeric feature centred and scaled by the consortium's pooled
mean and standard deviation (`fedlt.methods.standardise` fills them from secure sums in a table study's
opening round), with missing values imputed at the mean.

It holds its statistics as buffers, so they travel in the global state and in an exported model: a model
exported from a table study takes rows encoded by the plan's schema and standardises them itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedlt.models.base import SplitModel


class Standardise(nn.Module):
    """z_j = (x_j − mean_j) · scale_j for each numeric feature j, 0 (the mean) where its missing indicator is
    set; every other feature (one-hot categories, indicators) passes unchanged. Until `ready` is set the layer
    is the identity on all of them (mean 0, scale 1)."""

    def __init__(self, numeric: Sequence[int], indicators: Sequence[int]) -> None:
        super().__init__()
        if len(numeric) != len(indicators):
            raise ValueError("each numeric feature needs an indicator index (-1 for none)")
        self.register_buffer("numeric", torch.tensor(list(numeric), dtype=torch.int64))
        self.register_buffer("indicators", torch.tensor(list(indicators), dtype=torch.int64))
        self.register_buffer("mean", torch.zeros(len(numeric)))
        self.register_buffer("scale", torch.ones(len(numeric)))
        self.register_buffer("ready", torch.tensor(0, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.numeric) == 0:
            return x
        values = (x[:, self.numeric] - self.mean) * self.scale
        flagged = self.indicators >= 0
        if bool(flagged.any()):
            missing = torch.zeros_like(values)
            missing[:, flagged] = x[:, self.indicators[flagged]]
            values = values * (1 - missing)
        out = x.clone()
        out[:, self.numeric] = values
        return out


def standardising(model: SplitModel, numeric: Sequence[int], indicators: Sequence[int]) -> SplitModel:
    """`model` with a `Standardise` layer in front of its encoder (state keys `encoder.0.*` for the layer,
    `encoder.1.*` for the model's own encoder)."""
    layer = Standardise(numeric, indicators)
    return SplitModel.adopt(nn.Sequential(layer, model.encoder), model.classifier)


def standardise_layer(model: nn.Module) -> tuple[str, Standardise] | None:
    """The model's Standardise layer and its state-dict prefix, if it has one (a table model's first)."""
    return next(((f"{name}.", m) for name, m in model.named_modules() if isinstance(m, Standardise)), None)
