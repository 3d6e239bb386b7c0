"""What every fedlt model offers: a feature encoder and a linear classifier on top of it.

Long-tail methods act on the split: CReFF, CCVR, DFL-FS and SFD re-train `classifier` on features `encoder`
produces; RedGrape adds a second head. Keeping the split explicit avoids per-method surgery on architectures.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    """The built-in models make their classifier here (`SplitModel(encoder, feature_dim, num_classes)`); a
    user's model brings its own (`SplitModel.adopt`)."""

    def __init__(self, encoder: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self._hold(encoder, nn.Linear(feature_dim, num_classes))

    @classmethod
    def adopt(cls, encoder: nn.Module, classifier: nn.Linear) -> SplitModel:
        """A split of an existing network: `encoder` and `classifier` keep their weights and initialisation,
        so a user's factory decides them, under fedlt's seed, exactly as it would alone."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._hold(encoder, classifier)
        return model

    def _hold(self, encoder: nn.Module, classifier: nn.Linear) -> None:
        self.encoder = encoder
        self.classifier = classifier
        self.feature_dim = classifier.in_features
        self.num_classes = classifier.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))
