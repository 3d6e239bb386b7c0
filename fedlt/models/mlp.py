"""A multilayer perceptron for table rows: the built-in `mlp`.

Two ReLU hidden layers (128 and 64 units by default); the 64-d output of the second is the feature z on which
the long-tail methods re-train or add heads. Ours, not from a paper: the seeds' papers study images only.
"""

from __future__ import annotations

from torch import nn

from fedlt.models.base import SplitModel

HIDDEN = (128, 64)


def mlp(features: int, num_classes: int, hidden: tuple[int, ...] = HIDDEN) -> SplitModel:
    layers: list[nn.Module] = []
    width = features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return SplitModel(nn.Sequential(*layers), width, num_classes)
