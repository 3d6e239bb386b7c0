"""Attack (c): a decoder, trained on public data, that turns features back into images.

The aggregator holds the encoder (it sends the model) and data of its own, a split the consortium never
trained on; it fits a decoder from encoder features to images on that split (FLea's protocol, Xia et al.
2023, with an MLP instead of their convolutional decoder because the features here are vectors). Applied to
a real record's feature it shows what any recovered feature is worth; applied to recovered and synthetic
features (CReFF's federated features, Gaussian features regenerated from pooled statistics) it shows what the
release gives away. `prior` decodes the public mean feature of a class: what the attacker can draw without
any release, the baseline a leak must beat besides random images.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedlt.data.arrays import LabeledData
from fedlt.methods.heads import extract_features


class FeatureDecoder(nn.Module):
    def __init__(self, feature_dim: int, image_shape: tuple[int, int, int], hidden: int = 512) -> None:
        super().__init__()
        self.image_shape = image_shape
        self.net = nn.Sequential(
            nn.Linear(feature_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, int(np.prod(image_shape))),
            nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).view(-1, *self.image_shape)


def train_decoder(
    encoder_model: nn.Module, public: LabeledData, *, epochs: int = 30, seed: int = 0
) -> FeatureDecoder:
    """Adam on the pixel MSE of decoded public features, full passes in shuffled batches of 64."""
    x = torch.from_numpy(public.x)
    z = extract_features(encoder_model, x).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seeded weights without touching the caller's global generator
        torch.manual_seed(seed)
        decoder = FeatureDecoder(z.shape[1], public.input_shape)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(x), generator=generator).split(64):
            optimizer.zero_grad()
            nn.functional.mse_loss(decoder(z[batch]), x[batch]).backward()
            optimizer.step()
    return decoder.eval()


@torch.no_grad()
def decode(decoder: FeatureDecoder, features: torch.Tensor) -> np.ndarray:
    return decoder(features.float()).numpy()


def prior(decoder: FeatureDecoder, encoder_model: nn.Module, public: LabeledData, label: int) -> np.ndarray:
    """The attacker's guess without any release: its own data's mean feature of the class, decoded."""
    members = torch.from_numpy(public.x[public.y == label])
    return decode(decoder, extract_features(encoder_model, members).mean(dim=0, keepdim=True))
