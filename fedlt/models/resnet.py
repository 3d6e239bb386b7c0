"""CReFF's ResNet-8 (official `ResNet_cifar(resnet_size=8, scaling=4)`): 3 stages × 1 BasicBlock, 64/128/256.

conv3×3 → BN → ReLU, then BasicBlocks 64 (stride 1), 128 (stride 2), 256 (stride 2) with 1×1 conv+BN
shortcuts, global average pooling → 256-d post-ReLU feature, Linear(256, C); ≈1.23 M parameters. Convolutions
are initialised N(0, sqrt(2 / (k·k·out))) and BN to (1, 0), as in the official code.
Deviation: adaptive average pooling instead of the fixed `AvgPool2d(8)`; identical on 32×32 inputs, and it
also accepts 28×28 (MNIST) without padding. `in_channels` is configurable (the official model is 3-channel).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedlt.models.base import SplitModel


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet8(in_channels: int, num_classes: int) -> SplitModel:
    encoder = nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        BasicBlock(64, 64, 1),
        BasicBlock(64, 128, 2),
        BasicBlock(128, 256, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    for m in encoder.modules():
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / k))
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return SplitModel(encoder, 256, num_classes)
