"""Model table: names a config may use, the input sizes each accepts, and a seeded constructor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedlt.errors import ConfigError
from fedlt.models.base import SplitModel
from fedlt.models.cnn import mcmahan_cnn, small_cnn
from fedlt.models.resnet import resnet8


@dataclass(frozen=True)
class ModelEntry:
    build: Callable[[int, int], SplitModel]
    sides: tuple[int, ...]
    doc: str


MODELS: dict[str, ModelEntry] = {
    "cnn": ModelEntry(mcmahan_cnn, (28,), "McMahan et al. CNN for 28x28"),
    "cnn-small": ModelEntry(small_cnn, (8,), "small CNN for 8x8 (scikit-learn digits)"),
    "resnet8": ModelEntry(resnet8, (28, 32), "CReFF's ResNet-8, 256-d features"),
}

DEFAULT_FOR_SIDE = {28: "cnn", 8: "cnn-small", 32: "resnet8"}


def build_model(name: str, *, image_shape: tuple[int, int, int], num_classes: int, seed: int) -> SplitModel:
    """A freshly initialised model; the seed fixes the initial weights without touching global RNG state."""
    if name not in MODELS:
        raise ConfigError("model.name", [f"unknown model {name!r}; allowed: {', '.join(MODELS)}"])
    channels, height, width = image_shape
    entry = MODELS[name]
    if height != width or height not in entry.sides:
        raise ConfigError(
            "model.name",
            [f"{name} takes {' or '.join(f'{s}x{s}' for s in entry.sides)} images, got {height}x{width}"],
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return entry.build(channels, num_classes)


def dp_compatible(model: SplitModel) -> SplitModel:
    """The model with every layer Opacus cannot give per-sample gradients for replaced: BatchNorm mixes the
    samples of a batch, so it becomes GroupNorm (Opacus' `ModuleValidator.fix`). A deviation from the papers'
    ResNet-8, taken only under DP; the CNNs have no BatchNorm and come back unchanged."""
    from opacus.validators import ModuleValidator  # Opacus loads only for private training

    if not ModuleValidator.validate(model, strict=False):
        return model
    return ModuleValidator.fix(model)


__all__ = ["DEFAULT_FOR_SIDE", "MODELS", "SplitModel", "build_model", "dp_compatible"]
