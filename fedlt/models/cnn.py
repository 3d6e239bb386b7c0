"""McMahan et al.'s CNN (AISTATS 2017, "Communication-Efficient Learning…", §3) and a small variant for 8×8.

The 28×28 model is the paper's: two 5×5 convolutions (32, 64 channels, 'same' padding) each followed by 2×2
max-pooling, a 512-unit ReLU layer, and the output layer — 1,663,370 parameters for 10 classes. The 512-d ReLU
output is the feature z. The 8×8 variant (scikit-learn digits) keeps the shape of the design with 3×3 kernels,
16/32 channels and a 128-unit feature layer; it is ours, not the paper's.
"""

from __future__ import annotations

from torch import nn

from fedlt.models.base import SplitModel


def _conv_encoder(
    in_channels: int, widths: tuple[int, int], kernel: int, side: int, feature_dim: int
) -> nn.Sequential:
    c1, c2 = widths
    pad = kernel // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, kernel, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * (side // 4) ** 2, feature_dim),
        nn.ReLU(),
    )


def mcmahan_cnn(in_channels: int, num_classes: int) -> SplitModel:
    return SplitModel(_conv_encoder(in_channels, (32, 64), 5, 28, 512), 512, num_classes)


def small_cnn(in_channels: int, num_classes: int) -> SplitModel:
    return SplitModel(_conv_encoder(in_channels, (16, 32), 3, 8, 128), 128, num_classes)
