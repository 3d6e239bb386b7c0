"""What every fedlt model offers: a feature encoder and a linear classifier on top of it.

Long-tail methods act on the split: CReFF, CCVR, DFL-FS and SFD re-train `classifier` on features `encoder`
produces; RedGrape adds a second head. Keeping the split explicit avoids per-method surgery on architectures.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    def __init__(self, encoder: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))
