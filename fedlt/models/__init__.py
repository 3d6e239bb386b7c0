"""Model table: names a config may use, the inputs each accepts, and a seeded constructor; any other model is
named by entry point (`fedlt.models.entry`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from fedlt.errors import ConfigError
from fedlt.models.base import SplitModel
from fedlt.models.cnn import mcmahan_cnn, small_cnn
from fedlt.models.entry import ENTRY_FORM, ModelOptions, build_entry, parse_entry
from fedlt.models.mlp import mlp
from fedlt.models.resnet import resnet8


@dataclass(frozen=True)
class ModelEntry:
    """`build(first, num_classes)`: `first` is an image's channels, or a table row's feature count where
    `sides` is empty (a model of table rows)."""

    build: Callable[[int, int], SplitModel]
    sides: tuple[int, ...]
    doc: str

    def problem(self, input_shape: tuple[int, ...]) -> str | None:
        """Why this model cannot take samples of `input_shape`; None when it can."""
        if not self.sides:
            return None if len(input_shape) == 1 else f"takes table rows, got samples of shape {input_shape}"
        sizes = " or ".join(f"{s}x{s}" for s in self.sides)
        if len(input_shape) != 3:
            return f"takes {sizes} images, got table rows of {input_shape[0]} features"
        _, height, width = input_shape
        return (
            None
            if height == width and height in self.sides
            else f"takes {sizes} images, got {height}x{width}"
        )


MODELS: dict[str, ModelEntry] = {
    "cnn": ModelEntry(mcmahan_cnn, (28,), "McMahan et al. CNN for 28x28"),
    "cnn-small": ModelEntry(small_cnn, (8,), "small CNN for 8x8 (scikit-learn digits)"),
    "resnet8": ModelEntry(resnet8, (28, 32), "CReFF's ResNet-8, 256-d features"),
    "mlp": ModelEntry(mlp, (), "a 128-64 ReLU perceptron for table rows, 64-d features"),
}

_DEFAULT_FOR_SIDE = {28: "cnn", 8: "cnn-small", 32: "resnet8"}
DEFAULT_FOR_ROWS = "mlp"


def default_model(input_shape: tuple[int, ...]) -> str:
    """`auto`'s choice: the built-in for an image's side (ResNet-8 for other sides), `mlp` for table rows."""
    if len(input_shape) == 1:
        return DEFAULT_FOR_ROWS
    return _DEFAULT_FOR_SIDE.get(input_shape[1], "resnet8")


def build_model(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    seed: int,
    options: ModelOptions | None = None,
) -> SplitModel:
    """A freshly initialised model, built-in or named by entry point (`fedlt.models.entry`); the seed fixes
    the initial weights without touching global RNG state."""
    options = options or ModelOptions()
    if name in MODELS:
        make = _builtin(name, input_shape, num_classes, options)
    else:
        entry = parse_entry(name)
        if entry is None:
            allowed = f"{', '.join(MODELS)}, or an entry point {ENTRY_FORM}"
            raise ConfigError("model.name", [f"unknown model {name!r}; allowed: {allowed}"])
        make = partial(build_entry, entry, input_shape=input_shape, num_classes=num_classes, options=options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _builtin(
    name: str, input_shape: tuple[int, ...], num_classes: int, options: ModelOptions
) -> Callable[[], SplitModel]:
    """A built-in's constructor, once its input and options are checked (it takes none)."""
    entry = MODELS[name]
    problem = entry.problem(input_shape)
    if problem:
        raise ConfigError("model.name", [f"{name} {problem}"])
    if options:
        raise ConfigError("model.options", [f"the built-in model {name} takes no options"])
    return partial(entry.build, input_shape[0], num_classes)


def dp_compatible(model: SplitModel) -> SplitModel:
    """The model with every layer Opacus cannot give per-sample gradients for replaced: BatchNorm mixes the
    samples of a batch, so it becomes GroupNorm (Opacus' `ModuleValidator.fix`). A deviation from the papers'
    ResNet-8, taken only under DP; the CNNs have no BatchNorm and come back unchanged."""
    from opacus.validators import ModuleValidator  # Opacus loads only for private training

    if not ModuleValidator.validate(model, strict=False):
        return model
    return ModuleValidator.fix(model)


__all__ = [
    "ENTRY_FORM",
    "MODELS",
    "ModelOptions",
    "SplitModel",
    "build_model",
    "default_model",
    "dp_compatible",
]
